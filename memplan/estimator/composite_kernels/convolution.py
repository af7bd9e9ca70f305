"""Scratch of the CPU convolutions that oneDNN does not run: ATen's backends without groups (Slow2d's `thnn_conv2d`
and `_slow_conv2d_backward`; NNPACK's `_nnpack_spatial_convolution`, whose backward is SlowDilated2d's; SlowDilated2d's
`slow_conv_dilated2d`) allocate their im2col columns and the contiguous copies they work on inside the kernel, which
no dispatch mode sees (memplan.estimator.composite_kernels)."""

from __future__ import annotations

import math
from typing import Any

import torch

from memplan.estimator import composite_kernels
from memplan.estimator.composite_kernels import (
    _nbytes,
    bound_arguments,
    composite_kernel_scratch,
    contiguous_copy_bytes,
)
from memplan.estimator.memory_formats import meta_like, suggested_memory_format

_SUM = torch.ops.aten.sum.dim_IntList
_CONVOLUTION = torch.ops.aten.convolution.default
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default


def _subtensor(tensor: torch.Tensor, dim: int, groups: int, g: int) -> torch.Tensor:
    """The view Convolution.cpp's `subtensor` narrows, `tensor.narrow(dim, n * g, n)`, before its
    `.contiguous(tensor.suggest_memory_format())` (a copy unless the view is contiguous in that format)."""
    n = tensor.shape[dim] // groups
    return tensor.narrow(dim, n * g, n)


def _expanded(param: Any, dims: int) -> list[int]:
    """Convolution.cpp's `expand_param_if_needed`: a one-element stride, padding or dilation stands for every spatial
    dimension (`torch.ops.aten.convolution(x, w, None, [1], [1], [1], ...)` runs a 2-D convolution)."""
    values = [int(value) for value in param]
    return values * dims if len(values) == 1 else values


def mkldnn_runs(input: torch.Tensor, weight: torch.Tensor, stride: list[int], dilation: list[int], groups: int) -> bool:
    """`ConvParams::use_mkldnn` (aten/src/ATen/native/Convolution.cpp, torch 2.11-2.14; `input`, `weight` 4-D, as
    `_convolution` views a 1-D convolution before it selects its backend): 16-bit floats where the CPU has oneDNN's
    kernels for them; float32 unless it is a small one that THNN runs faster: a 1x1, unstrided, undilated kernel on
    one thread under a batch of 16, or one group, a kernel of 3 or less on a side, a batch of 1 and at most 20,480
    input elements (measured: a [1, 8, 16, 16] 3x3 convolution runs thnn_conv2d with oneDNN on). A 1-D one's
    [N, C, L] input and [O, I, k] weight read as their [N, C, 1, L] and [O, I, 1, k] views (a size-1 dimension
    changes neither the element count nor a kernel side that matters)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if input.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if input.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    if input.dtype != torch.float32:
        return False
    batch = input.shape[0]
    kernel = (weight.shape[-2], weight.shape[-1]) if weight.dim() == 4 else (1, weight.shape[-1])
    strided_or_dilated = any(s != 1 for s in stride) or any(d != 1 for d in dilation)
    not_one_by_one = strided_or_dilated or batch >= 16 or kernel != (1, 1) or composite_kernels.INTRA_OP_THREADS > 1
    large = groups > 1 or (kernel[0] > 3 and kernel[1] > 3) or batch > 1 or input.numel() > 20480
    return not_one_by_one and large


SLOW2D, NNPACK, SLOW_DILATED2D = "Slow2d", "NnpackSpatial", "SlowDilated2d"


def _cpu_backend(
    input: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int],
    transposed: bool, groups: int,
) -> str | None:  # fmt: skip
    """Which of ATen's CPU backends without groups `_select_conv_backend` (aten/src/ATen/native/Convolution.cpp, torch
    2.11-2.14) takes for this convolution in this process, `input` and `weight` 4-D (`_convolution` views a 1-D one as
    2-D before it selects): none where oneDNN runs it (mkldnn_runs), it is transposed or empty; SlowDilated2d where it
    is dilated; NnpackSpatial where `use_nnpack` holds (NNPACK built, initialised on this CPU and switched on,
    float32, a kernel under 17 and a padding under the kernel on each side, a batch of 16 or more); Slow2d
    otherwise."""
    if transposed or input.numel() == 0:
        return None
    if mkldnn_runs(input, weight, stride, dilation, groups):
        return None
    if any(d != 1 for d in dilation):
        return SLOW_DILATED2D
    kernel = weight.shape[2:]
    nnpack = (
        torch.backends.nnpack.is_available()
        and torch._C._get_nnpack_enabled()
        and input.dtype == torch.float32
        and all(k < 17 for k in kernel)
        and all(p < k for p, k in zip(padding, kernel, strict=True))
        and input.shape[0] >= 16
    )
    return NNPACK if nnpack else SLOW2D


def _output_area(
    input: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int]
) -> int:
    """oh * ow of a 2-D convolution (`conv_output_size`, ConvUtils.h)."""
    area = 1
    for size, kernel, s, p, d in zip(input.shape[2:], weight.shape[2:], stride, padding, dilation, strict=True):
        area *= (size + 2 * p - d * (kernel - 1) - 1) // s + 1
    return area


def _sample_columns_bytes(
    input: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int]
) -> int:
    """`slow_conv_dilated_all_cpu_template` (aten/src/ATen/native/NaiveDilatedConvolution.cpp): one sample's columns,
    `columns.resize_({nInputPlane * kh * kw, oh * ow})` (transposed for channels-last), reused for every sample and
    held until it returns; a 1x1 kernel's too (no view of the input, as Slow2d's)."""
    area = _output_area(input, weight, stride, padding, dilation)
    return weight.shape[1] * math.prod(weight.shape[2:]) * area * input.element_size()


def _columns_bytes(input: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int]) -> int:
    """`compute_columns2d` (aten/src/ATen/native/ConvolutionMM2d.cpp): the im2col buffer `at::empty({batch,
    channels * kh * kw, oh * ow})`, in either memory format, except a 1x1 kernel at stride 1 and no padding, whose
    columns are a view of the input. `input`, `weight` 4-D (a 1-D convolution viewed as 2-D)."""
    kh, kw = weight.shape[2], weight.shape[3]
    if (kh, kw) == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0]:
        return 0
    oh = (input.shape[2] + 2 * padding[0] - kh) // stride[0] + 1
    ow = (input.shape[3] + 2 * padding[1] - kw) // stride[1] + 1
    return input.shape[0] * input.shape[1] * kh * kw * oh * ow * input.element_size()


def _as_2d(
    input: torch.Tensor, weight: torch.Tensor, stride: Any, padding: Any, dilation: Any
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int], int]:
    """Convolution.cpp's 1-D to 2-D view (`input.contiguous()`, then view4d: a [N, C, 1, L] input), and the bytes
    of that contiguous copy; 2-D arguments as they are."""
    input, weight = meta_like(input), meta_like(weight)
    spatial = input.dim() - 2
    stride, padding, dilation = (_expanded(param, spatial) for param in (stride, padding, dilation))
    if input.dim() == 4:
        return input, weight, stride, padding, dilation, 0
    copy = contiguous_copy_bytes(input, torch.contiguous_format)
    return input.contiguous().unsqueeze(2), weight.unsqueeze(2), [1, *stride], [0, *padding], [1, *dilation], copy


def _thnn_format(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """`thnn_conv_use_channels_last` (ConvUtils.h): channels-last where the input's or the weight's suggested
    format is."""
    channels_last = torch.channels_last in (suggested_memory_format(input), suggested_memory_format(weight))
    return torch.channels_last if channels_last else torch.contiguous_format


def _backend_format(backend: str, input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """`determine_backend_memory_format` (Convolution.cpp): Slow2d and SlowDilated2d work channels-last where
    thnn_conv_use_channels_last says; NnpackSpatial always in the default format."""
    return torch.contiguous_format if backend == NNPACK else _thnn_format(input, weight)


def _bound_2d(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int], int] | None]:
    """The op's arguments by name, and its input, weight, stride, padding and dilation as `_as_2d` gives them; None for
    a 3-D convolution (Slow3d, not modelled here: 0) or a call without a strided input."""
    bound = bound_arguments(op, args, kwargs)
    input = bound["input"]
    if not isinstance(input, torch.Tensor) or input.dim() not in (3, 4):
        return bound, None
    return bound, _as_2d(input, bound["weight"], bound["stride"], bound["padding"], bound["dilation"])


def _forward_nogroup_bytes(
    backend: str, input: torch.Tensor, weight: torch.Tensor, has_bias: bool, geometry: tuple[list[int], ...]
) -> int:
    """What `_convolution_nogroup_backend` (Convolution.cpp) holds beside its output, its input and weight already
    contiguous in the backend's format:
    - Slow2d, `slow_conv2d_forward_out_cpu` (ConvolutionMM2d.cpp): the whole batch's im2col columns;
    - NnpackSpatial, `_nnpack_spatial_convolution` (NNPACK.cpp): `at::zeros({weight.size(0)})` for a missing bias
      (its `input.contiguous()` and `weight.contiguous()` are themselves here; its workspace is `posix_memalign`ed,
      thread-local and kept, never the tensor allocator's);
    - SlowDilated2d, `slow_conv_dilated2d_cpu` (NaiveDilatedConvolution.cpp): one sample's columns."""
    stride, padding, dilation = geometry
    if backend == SLOW2D:
        return _columns_bytes(input, weight, stride, padding)
    if backend == NNPACK:
        return 0 if has_bias else weight.shape[0] * input.element_size()
    return _sample_columns_bytes(input, weight, stride, padding, dilation)


@composite_kernel_scratch(_CONVOLUTION)
def slow_conv2d_forward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """A CPU convolution on a backend without groups (_cpu_backend: Slow2d, NnpackSpatial, SlowDilated2d), torch
    2.11-2.14.

    `_convolution` (Convolution.cpp) makes the input and weight contiguous in the backend's format (_backend_format),
    then, with one group, calls `_convolution_nogroup_backend` (_forward_nogroup_bytes: Slow2d's im2col columns are
    allocated before its output and freed as it returns). With several groups, each group's `subtensor` of the input
    and weight (a narrowed `.contiguous(format)`: a copy unless already contiguous) and what its backend holds are
    held beside the outputs of the groups before it, and `at::cat(outputs, 1)` makes the output while all of them are
    alive. Measured with torch.profiler (oneDNN off): a [2, 8, 16, 16] float32 input, 3x3 to 16 channels, holds
    147,456 B beside its 32,768 B output; depthwise, 20,480 B beside 16,384 B; at a batch of 16 (NNPACK) a depthwise
    7x7 over [16, 8, 32, 32] holds its 524,288 B output's worth of group outputs during the cat."""
    if device != "cpu":
        return 0
    bound, as_2d = _bound_2d(_CONVOLUTION, args, kwargs)
    if as_2d is None:
        return 0
    input, weight, stride, padding, dilation, held = as_2d
    groups, geometry = bound["groups"], (stride, padding, dilation)
    backend = _cpu_backend(input, weight, stride, padding, dilation, bound["transposed"], groups)
    if backend is None:
        return 0
    has_bias = isinstance(bound["bias"], torch.Tensor)
    memory_format = _backend_format(backend, input, weight)
    held += contiguous_copy_bytes(input, memory_format) + contiguous_copy_bytes(weight, memory_format)
    input, weight = input.contiguous(memory_format=memory_format), weight.contiguous(memory_format=memory_format)
    if groups == 1:
        return held + _forward_nogroup_bytes(backend, input, weight, has_bias, geometry)
    input_g, weight_g = _subtensor(input, 1, groups, 0), _subtensor(weight, 0, groups, 0)
    copies = contiguous_copy_bytes(input_g, suggested_memory_format(input)) + contiguous_copy_bytes(
        weight_g, suggested_memory_format(weight)
    )
    input_g = input_g.contiguous(memory_format=suggested_memory_format(input))
    weight_g = weight_g.contiguous(memory_format=suggested_memory_format(weight))
    inner = _forward_nogroup_bytes(backend, input_g, weight_g, has_bias, geometry)
    output = input.shape[0] * weight.shape[0] * _output_area(input, weight, *geometry) * input.element_size()
    # the last group: the groups' outputs (the output's bytes in all) and its copies and scratch; then the cat
    return held + max(copies + inner, output)


def _dilated_backward_bytes(
    grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, geometry: tuple[list[int], ...],
    mask: list[bool], device: str,
) -> int:  # fmt: skip
    """`slow_conv_dilated2d_backward_cpu` (aten/src/ATen/native/NaiveDilatedConvolution.cpp), the backward of
    NnpackSpatial ("nnpack backward does not support strided convolutions; use slow impl instead",
    `_convolution_backward_nogroup_backend`) and of SlowDilated2d: `grad_output.contiguous(format)` (the format
    thnn_conv_use_channels_last picks), the three gradients (the op's), then in `slow_conv_dilated_all_cpu_template`
    one sample's columns (where the input's or the weight's gradient is wanted) and, per sample, the bias's
    `grad_bias += grad_output_n.sum(dims)`, whose [out_channels] sum is held beside them a moment. Measured with
    torch.profiler (oneDNN off, a batch of 16, 32x32): a 1x1 from 32 to 8 channels holds 131,072 B of columns and
    32 B of sum."""
    memory_format = _thnn_format(input, weight)
    held = contiguous_copy_bytes(grad_output, memory_format)
    columns = _sample_columns_bytes(input, weight, *geometry) if mask[0] or mask[1] else 0
    if not mask[2]:
        return held + columns
    sample = grad_output.contiguous(memory_format=memory_format)[0]
    bias_sum = weight.shape[0] * grad_output.element_size() + composite_kernels.kernel_scratch_bytes(
        _SUM, (sample, [1, 2]), {}, device
    )
    return held + columns + bias_sum


@composite_kernel_scratch(_CONVOLUTION_BACKWARD)
def slow_conv2d_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The backward of a CPU convolution on a backend without groups (_cpu_backend), torch 2.11-2.14.

    `convolution_backward` (Convolution.cpp) makes the input and weight contiguous in the backend's format; with one
    group `_slow_conv2d_backward` (ConvolutionMM2d.cpp, Slow2d) computes the input's gradient from `grad_output.
    contiguous(format)` (its per-thread im2col buffer is `std::make_unique`, not the tensor allocator's), then the
    bias's, then the weight's from `grad_output.contiguous(format)` again and `compute_columns2d(input)`, both held
    beside the three gradients until it returns; NnpackSpatial and SlowDilated2d run `slow_conv_dilated2d_backward_cpu`
    (_dilated_backward_bytes). With several groups, each group's `subtensor` of grad_output, input and weight (copies
    unless contiguous) and what its backward holds are held beside the gradients of the groups before it, and the
    `at::cat`s make the gradients while all the groups' are alive. Measured with torch.profiler (oneDNN off): 3x3
    over a [2, 8, 16, 16] float32 input to 16 channels, 147,456 B beside its gradients."""
    if device != "cpu":
        return 0
    bound, as_2d = _bound_2d(_CONVOLUTION_BACKWARD, args, kwargs)
    grad_output = bound["grad_output"]
    if not isinstance(grad_output, torch.Tensor) or as_2d is None:
        return 0
    input, weight, stride, padding, dilation, held = as_2d
    groups, mask, geometry = bound["groups"], bound["output_mask"], (stride, padding, dilation)
    backend = _cpu_backend(input, weight, stride, padding, dilation, bound["transposed"], groups)
    if backend is None:
        return 0
    grad_output = meta_like(grad_output)
    if grad_output.dim() == 3:
        grad_output = grad_output.unsqueeze(2)
    memory_format = _backend_format(backend, input, weight)
    held += contiguous_copy_bytes(input, memory_format) + contiguous_copy_bytes(weight, memory_format)
    input, weight = input.contiguous(memory_format=memory_format), weight.contiguous(memory_format=memory_format)
    if groups == 1 and backend != SLOW2D:
        return held + _dilated_backward_bytes(grad_output, input, weight, geometry, mask, device)
    if groups == 1:
        grad_output_copy = contiguous_copy_bytes(grad_output, memory_format)
        columns = _columns_bytes(input, weight, stride, padding)
        # the bias's `at::sum_out(grad_bias, grad_output_, {0, 2, 3})` runs before the weight's gradient exists: a
        # 16-bit one sums float32 copies (reductions.sum_float_buffer_bytes; measured: a bfloat16 [2, 16, 6, 6]
        # gradient held 4,672 B beside its bias's 32 B)
        contiguous = grad_output.contiguous(memory_format=memory_format)
        bias_sum = composite_kernels.kernel_scratch_bytes(_SUM, (contiguous, [0, 2, 3]), {}, device)
        bias_stage = grad_output_copy + bias_sum - (_nbytes(weight) if mask[1] else 0)
        return held + max(
            grad_output_copy if mask[0] else 0,
            grad_output_copy + columns if mask[1] else 0,
            bias_stage if mask[2] else 0,
        )
    grad_output_g = _subtensor(grad_output, 1, groups, 0)
    input_g, weight_g = _subtensor(input, 1, groups, 0), _subtensor(weight, 0, groups, 0)
    copies = (
        contiguous_copy_bytes(grad_output_g, suggested_memory_format(grad_output))
        + contiguous_copy_bytes(input_g, suggested_memory_format(input))
        + contiguous_copy_bytes(weight_g, suggested_memory_format(weight))
    )
    grad_output_g = grad_output_g.contiguous(memory_format=suggested_memory_format(grad_output))
    input_g = input_g.contiguous(memory_format=suggested_memory_format(input))
    weight_g = weight_g.contiguous(memory_format=suggested_memory_format(weight))
    if backend == SLOW2D:
        # inside the group's backward, its inputs are contiguous in the format thnn_conv_use_channels_last picks for it
        inner = contiguous_copy_bytes(grad_output_g, _thnn_format(input_g, weight_g))
        columns = _columns_bytes(input_g, weight_g, stride, padding) if mask[1] else 0
        group = inner + columns if mask[0] or mask[1] else 0
    else:
        group = _dilated_backward_bytes(grad_output_g, input_g, weight_g, geometry, mask, device)
    gradients = (
        (_nbytes(input) if mask[0] else 0)
        + (_nbytes(weight) if mask[1] else 0)
        + (grad_output.shape[1] * grad_output.element_size() if mask[2] else 0)
    )
    return held + max(copies + group, gradients)
