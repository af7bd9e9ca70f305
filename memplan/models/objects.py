"""Models and batches given as Python objects, for notebooks: `memplan.estimate(model, inputs=...)`.

- an `nn.Module` the user already has, with real, meta or fake parameters. Its weights are never
  copied or touched: each build is a copy of the module tree whose parameters and buffers are new
  tensors of the same shapes and dtypes, made in the tensor mode memplan builds in (fake while
  tracing), so a 70B model on the meta device costs nothing; tied weights stay tied.
- a zero-argument callable (a class, a factory function, a lambda) returning one.
- inputs: a function of the batch size, as --inputs names one, or a batch (a tensor, a tuple of
  tensors, a dict of keyword arguments) whose rows are repeated or cut to the batch size asked for.
- loss: a function fn(output, batch), or None for the model's own loss.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memplan.errors import InputsError, UsageError, a_type
from memplan.estimator.leaves import refuse_sparse_tensors
from memplan.models.imports import import_object
from memplan.models.source import (
    Batch,
    ModelRef,
    ModelSpec,
    _call_user,
    _check_batch,
    _check_signature,
    _checked_loss,
    default_loss,
    not_a_module,
    refuse_loss_with_step,
)
from memplan.settings import TrainingSettings


def is_model_object(model: Any) -> bool:
    """An nn.Module or a callable returning one, as opposed to a name the CLI would take."""
    return isinstance(model, nn.Module) or callable(model)  # names (str, paths) are not callable


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are new empty CPU tensors (fake ones under a fake mode), each
    tied weight once: what a model object, or a factory's model built on the meta device, is traced as. Tensors a
    module keeps in a plain attribute (peft's prompt and prefix tuning keep `prompt_tokens = {"default":
    torch.arange(num_virtual_tokens)}` on the PeftModel) are new tensors of the same shape and dtype as well, their
    values copied where both sides are real: copied by deepcopy, a real tensor under the fake mode had failed in torch
    ("Attempted to set the storage of a tensor on device "meta" to a storage on different device "cpu"")."""
    refuse_sparse_tensors(model)  # (copied, one would become a dense tensor of its full shape)
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) not in memo:  # parameters() lists a tied weight once; buffers are never tied
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            memo[id(tensor)] = (
                nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
            )
    for module in model.modules():
        for tensor in _attribute_tensors(vars(module)):
            if id(tensor) not in memo:
                memo[id(tensor)] = _same_tensor(tensor)
    return copy.deepcopy(model, memo)


def _attribute_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a module's attributes (its `__dict__`), in the dicts, lists and tuples they hold: parameters and
    buffers among them, which skeleton has already replaced."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, Mapping):
        for item in value.values():
            yield from _attribute_tensors(item, depth + 1)
    elif depth < 4 and isinstance(value, list | tuple | set):
        for item in value:
            yield from _attribute_tensors(item, depth + 1)


def _same_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A new CPU tensor of `tensor`'s shape and dtype in the active tensor mode (fake under one), holding its values
    where both are real (a traced step reads no values; a real run may index with them)."""
    made = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    if not isinstance(made, FakeTensor) and not isinstance(tensor, FakeTensor) and not tensor.is_meta:
        with torch.no_grad():
            made.copy_(tensor)
    return made.requires_grad_() if tensor.requires_grad else made


def _rows(batch: Batch) -> int:
    tensors = (
        list(batch.values()) if isinstance(batch, Mapping) else list(batch) if isinstance(batch, tuple) else [batch]
    )
    sizes = {tensor.shape[0] for tensor in tensors if isinstance(tensor, torch.Tensor) and tensor.dim() > 0}
    if len(sizes) != 1:
        raise InputsError(
            "a batch given as inputs needs one leading (batch) dimension shared by its tensors; got "
            f"{sorted(sizes) or 'none'}: pass a function of the batch size instead"
        )
    return sizes.pop()


def _resized(batch: Batch, size: int, rows: int) -> Batch:
    """Rows repeated or cut to `size`, made by an op so the batch is the step's own (inputs memory). One tensor
    given under two names (a causal LM's `{"ids": t, "labels": t}`) stays one tensor, as an inputs function's
    batch keeps it: resized apart, it was counted twice."""
    index = torch.arange(size) % rows
    resized: dict[int, torch.Tensor] = {}

    def resize(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if id(value) not in resized:
                resized[id(value)] = value.index_select(0, index)
            return resized[id(value)]
        return value

    if isinstance(batch, Mapping):
        return {key: resize(value) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(resize(value) for value in batch)
    return resize(batch)


def batch_size_of(inputs: Any) -> int | None:
    """The batch size a batch given as inputs has (None for a function of the batch size)."""
    if not isinstance(inputs, torch.Tensor | tuple | Mapping):
        return None  # a function, a name, or a mistake the model's own route reports
    return _rows(_check_batch(inputs, "inputs"))


def object_spec(model: Any, inputs: Any, loss: Any) -> ModelSpec:
    """A ModelSpec for a model object or factory callable (see the module docstring)."""
    name = (
        f"{type(model).__name__} (object)"
        if isinstance(model, nn.Module)
        else getattr(model, "__qualname__", repr(model))
    )
    if not isinstance(model, nn.Module):
        _check_signature(model, (), UsageError, f"model factory {name!r} must be callable with no arguments")
    if inputs is None:
        raise UsageError("a model object needs its batch: pass inputs=fn(batch_size) or inputs=a batch of tensors")
    if isinstance(inputs, str):
        inputs = import_object(inputs, "inputs")
    if isinstance(loss, str):
        loss = import_object(loss, "loss")
    if callable(inputs):
        _check_signature(inputs, (1,), InputsError, "inputs must take one argument, the batch size")
        inputs_name = getattr(inputs, "__qualname__", "inputs")

        def make_batch(settings: TrainingSettings, dtype: torch.dtype) -> Batch:
            return _check_batch(_call_user(inputs, (settings.batch_size,), f"inputs {inputs_name!r}"), inputs_name)

    else:
        inputs_name = f"{a_type(inputs)} batch"
        rows = _rows(_check_batch(inputs, "inputs"))

        def make_batch(settings: TrainingSettings, dtype: torch.dtype) -> Batch:
            return _resized(inputs, settings.batch_size, rows)

    if loss is not None and not callable(loss):
        raise UsageError(f"loss must be a function fn(output, batch) or None, got {a_type(loss)}")
    if loss is not None:
        _check_signature(loss, (None, None), UsageError, "loss must take two arguments, the output and the batch")

    def build(settings: TrainingSettings) -> nn.Module:
        built = model if isinstance(model, nn.Module) else _call_user(model, (), f"model factory {name!r}")
        if not isinstance(built, nn.Module):
            raise not_a_module(name, built)
        return skeleton(built)

    def loss_of(output: Any, batch: Batch) -> torch.Tensor:
        return _checked_loss("loss", loss(output, batch)) if loss is not None else default_loss(output, batch)

    def settings_for(settings: TrainingSettings) -> TrainingSettings:
        refuse_loss_with_step(loss, settings)
        if settings.seq_len is not None or settings.image_size is not None or settings.target_len is not None:
            raise UsageError(
                "seq_len, target_len and image_size shape the batches memplan makes; size the inputs instead"
            )
        return settings

    return ModelSpec(ModelRef(name, inputs_name), build, make_batch, loss_of, settings_for=settings_for)
