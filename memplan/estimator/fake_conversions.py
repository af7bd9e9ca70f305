"""Module conversions in a user's model factory (`.to(torch.bfloat16)`, `.half()`, `.cuda()`),
made to work while memplan builds the model under fake tensors.

- `nn.Module._apply` swaps each fake parameter for its converted copy with `torch.utils.swap_tensors`
  (torch/nn/modules/module.py: it always swaps FakeTensor parameters), which fails on them
  ("_apply(): Couldn't swap Linear.weight"). Here a converted parameter replaces the old one in
  `_parameters` instead, once per parameter so tied weights stay tied, as memplan's own
  `cast_floating_point` (below) does: the same memory as an in-place conversion.
- `copy.deepcopy` of a module (nn.TransformerEncoder and nn.Transformer copy their layer; `_get_clones`
  code) copies each fake parameter's `__dict__`, and with it its FakeTensorMode (Tensor.__deepcopy__,
  torch/_tensor.py): the copy then belongs to another mode, which the active one converts afresh at every
  op, so its views read a storage that is not the parameter's and its weights were counted twice (393,212 B
  too many on tests/test_fake_conversions.py's 3-layer nn.TransformerEncoder in float32). A mode is not
  copied here: the copies stay in the active one.
  The copy asks each fake tensor for its data pointer on the way (torch warns "Accessing the data pointer
  of FakeTensor is deprecated"), about torch's code, not the user's: not shown.
- `torch.nn.utils.parametrizations.orthogonal` on a square weight asks whether the weight is orthogonal
  already (`_is_orthogonal`: `torch.allclose`, which reads values and fake tensors refuse: the factory
  failed as if the user's code were wrong) to decide between copying it and orthogonalizing it by QR for
  the parametrization's `base` buffer. Either way `base` is a new tensor of the weight's shape and dtype,
  and a freshly initialized weight is not orthogonal: here it is taken not to be.
- Device moves become no-ops: memplan traces on fake CPU tensors whatever the target (design.md
  §3), models a cuda target by its kernels and allocator, and fake CUDA tensors would abort the
  process in autograd. `.cuda()`, `.to("cuda")` and `.to(device=...)` keep the device and apply
  only the dtype.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import patch

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


def _apply_replacing(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
    converted: dict[int, nn.Parameter] = {}

    def visit(current: nn.Module) -> None:
        for key, param in list(current._parameters.items()):
            if param is None:
                continue
            if id(param) not in converted:
                with torch.no_grad():
                    applied = fn(param)
                converted[id(param)] = (
                    param if applied is param else nn.Parameter(applied, requires_grad=param.requires_grad)
                )
            current._parameters[key] = converted[id(param)]
        for key, buffer in list(current._buffers.items()):
            if buffer is not None:
                current._buffers[key] = fn(buffer)
        if recurse:
            for child in current.children():
                visit(child)

    visit(module)
    return module


def _stay_on_this_device(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def to(self: torch.Tensor, *args: Any, copy: bool = False, **kwargs: Any) -> torch.Tensor:
        # _parse_to does not take `copy`; a copy is a new tensor wherever it is made
        # (bitsandbytes copies its quantization code table per layer: `code.to(device, copy=True)`).
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        options: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
        if memory_format is not None:
            options["memory_format"] = memory_format
        if copy:
            return original(self, copy=True, **options)
        if dtype is None and (device is None or device == self.device):
            return self if memory_format is None else original(self, memory_format=memory_format)
        return original(self, **options) if options else self

    return to


@contextlib.contextmanager
def fake_friendly_conversions() -> Iterator[None]:
    """While a model factory runs under memplan's fake tensors (not for real runs)."""
    original_apply, original_to, original_cuda = nn.Module._apply, torch.Tensor.to, torch.Tensor.cuda
    nn.Module._apply = _apply_replacing  # type: ignore[method-assign]
    torch.Tensor.to = _stay_on_this_device(original_to)  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        with copies_stay_in_their_mode(), _orthogonal_weights_taken_as_new():
            yield
    finally:
        nn.Module._apply = original_apply  # type: ignore[method-assign]
        torch.Tensor.to = original_to  # type: ignore[method-assign]
        torch.Tensor.cuda = original_cuda  # type: ignore[method-assign]


@contextlib.contextmanager
def _orthogonal_weights_taken_as_new() -> Iterator[None]:
    """`parametrizations.orthogonal`'s test of a square weight (module docstring): not orthogonal, as a freshly
    initialized one is not; where the module is missing (another torch), nothing to do."""
    from torch.nn.utils import parametrizations

    if not hasattr(parametrizations, "_is_orthogonal"):
        yield
        return
    with patch.object(parametrizations, "_is_orthogonal", lambda Q, eps=None: False):
        yield


@contextlib.contextmanager
def copies_stay_in_their_mode() -> Iterator[None]:
    """`copy.deepcopy` of fake tensors keeps them in their FakeTensorMode (module docstring): in a model factory,
    and in a user's `--step`, which copies the model for an average of its weights (torch.optim.swa_utils'
    AveragedModel, an EMA or teacher model kept beside it: its copy in another mode was counted as a constant
    live through the step and again as each op's conversion of it). No-op where no fake tensor is copied."""
    own_deepcopy = FakeTensorMode.__dict__.get("__deepcopy__")
    FakeTensorMode.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)
            yield
    finally:
        if own_deepcopy is None:
            del FakeTensorMode.__deepcopy__  # type: ignore[attr-defined]
        else:
            FakeTensorMode.__deepcopy__ = own_deepcopy  # type: ignore[attr-defined]


def cast_floating_point(
    model: nn.Module,
    dtype: torch.dtype,
    *,
    buffers: bool = True,
    frozen: bool = False,
    keep: frozenset[int] = frozenset(),
) -> None:
    """`model.to(dtype)` for floating-point parameters (and buffers, unless `buffers=False`), also
    under fake tensors; `frozen` leaves the parameters without requires_grad, as peft's
    prepare_model_for_kbit_training does when it casts; the parameters whose ids are in `keep` stay as
    they are.

    `nn.Module.to` swaps parameter storage in place, which fake tensors refuse; replacing each
    parameter (once, so tied weights stay tied) gives the same memory.
    """
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or id(param) in keep:
                continue
            if id(param) not in replaced:
                requires_grad = param.requires_grad and not frozen
                replaced[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=requires_grad)
            module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()) if buffers else ():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)
