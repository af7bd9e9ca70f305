"""Recurrent kernels: oneDNN's LSTM layer returns a workspace, and allocates scratch inside itself, whose sizes fake
tensors don't know.

The meta kernel of `aten.mkldnn_rnn_layer` returns an empty workspace (torch 2.13), while the real
CPU kernel returns oneDNN's training workspace (573,440 bytes for a 96-unit layer, batch 4, 24
steps). oneDNN sizes it from the primitive descriptor alone, so memplan asks oneDNN: it runs the
layer once on real zero tensors of the same shapes, strides and dtypes and caches the answer. The same run reads,
from the CPU allocator's events, what the kernel holds inside itself beside its outputs
(memplan.estimator.composite_kernels.onednn_rnn).
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan.estimator.oprules import OutputLayout, fake_kernel_rule, output_bytes_rule
from memplan.profiled_allocations import profiled_call, profiler_running


class KernelRun(NamedTuple):
    output_bytes: tuple[int, ...]  # each tensor output's storage
    held_beside_outputs: int | None  # the most bytes the kernel held at once beyond them; None where unmeasured


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, list | tuple):
        return tuple(_spec(item) for item in value)
    return value


def _specs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, tuple]:
    """A call's arguments as hashable specs (the probes' cache keys)."""
    return _spec(args), tuple(sorted(_spec(kwargs).items()))


def _materialize(spec: Any) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        return _zeros(spec[1], spec[2], spec[3])
    if isinstance(spec, tuple):
        return [_materialize(item) for item in spec]
    return spec


def _zeros(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype).zero_()


_LAYER = torch.ops.aten.mkldnn_rnn_layer.default
_LAYER_BACKWARD = torch.ops.aten.mkldnn_rnn_layer_backward.default


def _arguments(op: Any, arg_specs: tuple, kwarg_specs: tuple) -> tuple[list[Any], dict[str, Any]]:
    """Real zeros for the call's tensors. The backward's workspace is the forward's: a fake one is empty (the meta
    kernel's), and oneDNN reads the whole of it (an empty one crashes the process), so the forward of the same
    layer is run for it."""
    args = [_materialize(spec) for spec in arg_specs]
    kwargs = {key: _materialize(spec) for key, spec in kwarg_specs}
    if op is _LAYER_BACKWARD and not kwargs and len(args) == 23:
        (input, w1, w2, w3, w4, hx, cx, _, _, _, _, _, _, reverse, mode, hidden_size, num_layers, has_biases, train,
         bidirectional, batch_sizes, batch_first, _) = args  # fmt: skip
        forward = (input, w1, w2, w3, w4, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers, has_biases)
        with torch.enable_grad():  # under no_grad (a backward's), the layer returns no workspace
            args[-1] = _LAYER(*forward, bidirectional, batch_first, train)[3]
    return args, kwargs


@cache
def _measured_run(op: Any, arg_specs: tuple, kwarg_specs: tuple) -> KernelRun:
    """The op run once on zeros, under torch.profiler's memory events (which see inside the kernel)."""
    with unset_fake_temporarily():
        args, kwargs = _arguments(op, arg_specs, kwarg_specs)
        outputs, peak, end = profiled_call(lambda: op(*args, **kwargs))  # outputs kept: their bytes are `end`
    return KernelRun(_output_bytes(outputs), peak - end)


@cache
def _plain_run(op: Any, arg_specs: tuple, kwarg_specs: tuple) -> tuple[int, ...]:
    with unset_fake_temporarily():
        args, kwargs = _arguments(op, arg_specs, kwarg_specs)
        return _output_bytes(op(*args, **kwargs))


def _output_bytes(outputs: Any) -> tuple[int, ...]:
    return tuple(out.untyped_storage().nbytes() for out in outputs if isinstance(out, torch.Tensor))


def kernel_run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> KernelRun:
    """`op` run on real zeros shaped as `args`: its outputs' bytes and, unless a profiler is already running (one
    cannot nest), what it held beside them."""
    arg_specs, kwarg_specs = _specs(args, kwargs)
    if profiler_running():
        return KernelRun(_plain_run(op, arg_specs, kwarg_specs), None)
    return _measured_run(op, arg_specs, kwarg_specs)


@output_bytes_rule(torch.ops.aten.mkldnn_rnn_layer.default)
def mkldnn_rnn_layer(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    if device != "cpu":  # the workspace alone: the kernel's scratch is read for the cpu target only (onednn_rnn)
        arg_specs, kwarg_specs = _specs(args, kwargs)
        return list(_plain_run(_LAYER, arg_specs, kwarg_specs))
    return list(kernel_run(_LAYER, args, kwargs).output_bytes)


_GRU_MODE = 3  # ideep::rnn_kind::GRU


def _contiguous(shape: list[int] | torch.Size) -> OutputLayout:
    shape = list(shape)
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return shape, strides, torch.float32


@fake_kernel_rule(_LAYER_BACKWARD)
def mkldnn_rnn_layer_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[OutputLayout, ...]:
    """The layer's gradients as the CPU kernel makes them (`onednn_rnn_layer_backward`, aten/src/ATen/native/mkldnn/
    RNN.cpp, torch 2.11-2.14): contiguous float32 tensors `at::empty` makes, and the bias gradient twice, the second
    `auto diff_b2_ = at::clone(diff_b_)`, its own storage. The meta kernel (torch/_meta_registrations.py) returns one
    tensor in both places: traced by it, each layer's backward was a bias gradient (4 × hidden float32s) low."""
    names = ("input", "weight0", "weight1", "weight2", "weight3", "hx_", "cx_tmp")
    bound = dict(zip(names, args, strict=False)) | kwargs
    mode = args[14] if len(args) > 14 else kwargs["mode"]
    hidden_size = args[15] if len(args) > 15 else kwargs["hidden_size"]
    weight2 = bound["weight2"]
    bias = _contiguous([4 * hidden_size] if mode == _GRU_MODE else [weight2.shape[0]])
    return (
        _contiguous(bound["input"].shape),
        _contiguous(bound["weight0"].shape),
        _contiguous(bound["weight1"].shape),
        bias,
        bias,
        _contiguous(bound["hx_"].shape),
        _contiguous(bound["cx_tmp"].shape),
    )
