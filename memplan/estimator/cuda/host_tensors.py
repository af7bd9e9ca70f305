"""Tensors a real CUDA run keeps in host memory, which the cuda target (fake CPU tensors throughout) would
otherwise count on the GPU: liveness takes them out of the device's figures (their host bytes join an offload's).

- torch.optim's step counters: `_init_group` makes `state["step"]` with `torch.tensor(0.0, ...)` on the host
  unless the group is capturable or fused (torch/optim/adam.py, note [special device hosting for step];
  likewise adamax, nadam (its `mu_product` too), radam, adadelta, adagrad, rmsprop, rprop; _adafactor.py
  always), but ASGD makes them on the parameter's device. Which of an optimizer's state entries are the
  host's is asked of torch itself (`host_state_keys`): a probe of the same class and options over a
  parameter on the meta device, which stands for the GPU.
- Memory-efficient attention's philox seed and offset: with dropout, `_efficient_attention_forward`
  (aten/src/ATen/native/transformers/cuda/attention.cu, torch 2.11-2.14) makes them with
  `at::scalar_tensor(..., at::dtype(at::kLong))`, host tensors outside CUDA-graph capture (on ROCm the
  GPU's); without dropout `at::empty({}, ...device(device))`, the GPU's. Flash attention's rng_state and
  cuDNN attention's seed and offset are the GPU's (flash_api.cpp mha_fwd; attention.cu
  `_scaled_dot_product_cudnn_attention_cuda`, `query.options()`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils._python_dispatch import _disable_current_modes

from memplan.estimator.optimizers import local_optimizer

_recorders: list[list[torch.Tensor]] = []


@contextlib.contextmanager
def host_outputs_recorded() -> Iterator[list[torch.Tensor]]:
    """While active, the kernels' host outputs (`note_on_host`) are appended to the yielded list."""
    recorded: list[torch.Tensor] = []
    _recorders.append(recorded)
    try:
        yield recorded
    finally:
        _recorders.remove(recorded)


def note_on_host(*tensors: torch.Tensor) -> None:
    """A kernel made `tensors` in host memory on a real GPU."""
    for recorded in _recorders:
        recorded.extend(tensors)


def efficient_attention_rng_on_host(dropout_p: float) -> bool:
    """attention.cu `_efficient_attention_forward`: the philox seed and offset are host tensors with dropout
    (outside CUDA-graph capture, on CUDA not ROCm), the GPU's without."""
    return dropout_p > 0.0 and torch.version.hip is None


@dataclass(frozen=True)
class _TensorOption:
    """A tensor option (a tensor `lr` or `betas`) in a probe's key: its dtype and shape, not the tensor, which may be
    the trace's fake one and would be kept alive by the cache. `_init_group` places the step counters by `capturable`
    and `fused` alone (adam.py), so a real CPU tensor of the same dtype and shape stands for it."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def materialized(self) -> torch.Tensor:
        return torch.full(self.shape, 1e-3, dtype=self.dtype)


def _option_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorOption(value.dtype, tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return tuple(_option_key(item) for item in value)
    return value


def _option_value(key: Any) -> Any:
    if isinstance(key, _TensorOption):
        return key.materialized()
    if isinstance(key, tuple):
        return tuple(_option_value(item) for item in key)
    return key


def _options_key(group: dict) -> tuple | None:
    """The group's options, hashable; None where one cannot stand in a probe (an unhashable value)."""
    items = tuple((name, _option_key(value)) for name, value in sorted(group.items()) if name != "params")
    try:
        hash(items)
    except TypeError:
        return None
    return items


@functools.cache
def _probed_host_keys(optimizer_class: type[Optimizer], options: tuple) -> frozenset[str]:
    with _disable_current_modes():  # a real meta parameter, not the trace's fake one
        param = torch.nn.Parameter(torch.empty(2, 2, device="meta"))
        param.grad = torch.empty(2, 2, device="meta")
        try:
            probe = optimizer_class([param])
        except (TypeError, ValueError, RuntimeError):
            return frozenset()
        # the group's options as `step` reads them
        probe.param_groups[0].update({name: _option_value(key) for name, key in options})
        with contextlib.suppress(Exception):
            # The state exists once `_init_group` ran; what follows may need values meta tensors lack (.item()).
            # A fused group fails before it (`_device_dtype_check_for_fused`): fused steps are the GPU's.
            probe.step()
        state = probe.state.get(param, {})
        return frozenset(
            name for name, value in state.items() if isinstance(value, torch.Tensor) and value.device.type == "cpu"
        )


def host_state_keys(optimizer_class: type[Optimizer], group: dict) -> frozenset[str]:
    """The state entries torch.optim's `optimizer_class` keeps on the host for a GPU parameter of `group`.
    Only torch's own optimizers are probed (another class's constructor or step may have effects)."""
    if not optimizer_class.__module__.startswith("torch.optim"):
        return frozenset()
    options = _options_key(group)
    return frozenset() if options is None else _probed_host_keys(optimizer_class, options)


def optimizer_host_tensors(optimizer: Optimizer | None) -> list[torch.Tensor]:
    """The optimizer's state tensors a GPU run keeps in host memory."""
    if optimizer is None:
        return []
    holder = local_optimizer(optimizer)  # under --parallel zero1, the one that holds the state
    host = []
    for group in holder.param_groups:
        keys = host_state_keys(type(holder), group)
        for param in group["params"]:
            state = holder.state.get(param, {})
            host += [state[key] for key in keys if isinstance(state.get(key), torch.Tensor)]
    return host


def _written_arguments(node: Any) -> list[Any]:
    """The arguments the node's op writes in place (its schema's `Tensor(a!)` ones), lists flattened."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        written += list(value) if isinstance(value, (list, tuple)) else [value]
    return written


def host_operands(nodes: Sequence[Any], storages: Sequence[Sequence[tuple[Any, int]]], host: Iterable[Any]) -> set[Any]:
    """`host` and the storages that must be host memory with them: what an op reads while writing in place into
    host tensors only (a CPU kernel takes no GPU operand: TensorIterator's device check lets only a CPU scalar
    meet GPU tensors, never the reverse), such as the `torch.tensor(1.0, device="cpu")` that adam.py's
    `_multi_tensor_adam` adds to host step counters; and the constant a `lift_fresh` copied, which is the tensor
    `torch.tensor` made (under fake tensors it becomes a graph constant and its lifted copy)."""
    found = set(host)
    if not found:
        return found
    index_of = {node: index for index, node in enumerate(nodes)}

    def keys(node: Any) -> list[Any]:
        return [key for key, _ in storages[index_of[node]]] if node in index_of else []

    for node in reversed(nodes):  # a consumer before its producers
        if node.op != "call_function":
            continue
        lifted = node.target in _LIFTS and any(key in found for key in keys(node))
        # copy_ and its kin move data across devices: their source may be the GPU's.
        written = [] if "copy" in str(node.target) else [arg for arg in _written_arguments(node) if arg in index_of]
        into_host = bool(written) and all(key in found for arg in written for key in keys(arg))
        if into_host or lifted:
            found.update(key for source in node.all_input_nodes for key in keys(source))
    return found


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
