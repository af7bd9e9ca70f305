"""Scratch of the CPU convolutions that oneDNN does not run: ATen's backends (Slow2d's `thnn_conv2d` and
`_slow_conv2d_backward`; NNPACK's `_nnpack_spatial_convolution`, whose backward is SlowDilated2d's; SlowDilated2d's and
SlowDilated3d's `slow_conv_dilated{2,3}d`; Slow3d's `slow_conv3d`; SlowTranspose2d's and SlowTranspose3d's
`slow_conv_transpose{2,3}d`) allocate their im2col columns and the contiguous copies they work on inside the kernel,
which no dispatch mode sees (memplan.estimator.composite_kernels). This module picks the backend and splits the groups
as Convolution.cpp does; what each backend holds for one group is memplan.estimator.composite_kernels.
convolution_backends'."""

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
from memplan.estimator.composite_kernels.convolution_backends import (
    NNPACK,
    SLOW2D,
    SLOW3D,
    SLOW_DILATED2D,
    SLOW_DILATED3D,
    SLOW_TRANSPOSE2D,
    SLOW_TRANSPOSE3D,
    SPLITS_GROUPS,
    Geometry,
    batch_columns_bytes,
    dilated_backward_bytes,
    forward_bytes,
    output_bytes,
    output_storage_bytes,
    transposed_or_3d_backward_bytes,
)
from memplan.estimator.memory_formats import meta_like, prims_suggest_memory_format, suggested_memory_format
from memplan.estimator.oprules import output_bytes_rule

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


def mkldnn_runs(
    input: torch.Tensor, weight: torch.Tensor, stride: list[int], dilation: list[int], groups: int,
    transposed: bool = False, output_padding: list[int] | None = None,
) -> bool:  # fmt: skip
    """`ConvParams::use_mkldnn` (aten/src/ATen/native/Convolution.cpp, torch 2.11-2.14; `input`, `weight` 4-D, as
    `_convolution` views a 1-D convolution before it selects its backend, or 5-D): never for a transposed one whose
    output padding is as large as its stride (`is_output_padding_big`); 16-bit floats where the CPU has oneDNN's
    kernels for them; float32 unless it is a small one that THNN runs faster: a 1x1, unstrided, undilated kernel on
    one thread under a batch of 16, or one group, a kernel of 3 or less on a side, a batch of 1 and at most 20,480
    elements in the input's first four dimensions (measured: a [1, 8, 16, 16] 3x3 convolution runs thnn_conv2d with
    oneDNN on). A 1-D one's [N, C, L] input and [O, I, k] weight read as their [N, C, 1, L] and [O, I, 1, k] views
    (a size-1 dimension changes neither the element count nor a kernel side that matters)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if transposed and any(p >= s for p, s in zip(output_padding or [], stride, strict=False)):
        return False
    if input.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if input.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    if input.dtype != torch.float32:
        return False
    batch = input.shape[0]
    kernel = (weight.shape[-2], weight.shape[-1]) if weight.dim() >= 4 else (1, weight.shape[-1])
    strided_or_dilated = any(s != 1 for s in stride) or any(d != 1 for d in dilation)
    not_one_by_one = strided_or_dilated or batch >= 16 or kernel != (1, 1) or composite_kernels.INTRA_OP_THREADS > 1
    elements = math.prod(input.shape[:4])
    large = groups > 1 or (kernel[0] > 3 and kernel[1] > 3) or batch > 1 or elements > 20480
    return not_one_by_one and large


def _cpu_backend(input: torch.Tensor, weight: torch.Tensor, geometry: Geometry, groups: int) -> str | None:
    """Which of ATen's CPU backends `_select_conv_backend` (aten/src/ATen/native/Convolution.cpp, torch 2.11-2.14)
    takes for this convolution in this process, `input` and `weight` 4-D (`_convolution` views a 1-D one as 2-D
    before it selects) or 5-D: none where oneDNN runs it (mkldnn_runs) or it is empty; for a 5-D input
    SlowTranspose3d where it is transposed, SlowDilated3d where it is dilated, Slow3d otherwise; for a 4-D one
    SlowTranspose2d where it is transposed, SlowDilated2d where it is dilated, NnpackSpatial where `use_nnpack` holds
    (NNPACK built, initialised on this CPU and switched on, float32, a kernel under 17 and a padding under the kernel
    on each side, a batch of 16 or more), Slow2d otherwise."""
    if input.numel() == 0:
        return None
    stride, padding, dilation = geometry.stride, geometry.padding, geometry.dilation
    if mkldnn_runs(input, weight, stride, dilation, groups, geometry.transposed, geometry.output_padding):
        return None
    dilated = any(d != 1 for d in dilation)
    if input.dim() == 5:
        return SLOW_TRANSPOSE3D if geometry.transposed else SLOW_DILATED3D if dilated else SLOW3D
    if geometry.transposed:
        return SLOW_TRANSPOSE2D
    if dilated:
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


def _as_spatial(
    bound: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, Geometry, int]:
    """The op's input and weight as `_convolution` hands them to a backend, with their geometry, and the bytes of the
    contiguous copy a 1-D one's view makes: Convolution.cpp's 1-D to 2-D view (`input.contiguous()`, then view4d: a
    [N, C, 1, L] input; `view1d_as_2d` puts 1, 0, 1 and 0 before the stride, padding, dilation and output padding);
    2-D and 3-D arguments as they are."""
    input, weight = meta_like(bound["input"]), meta_like(bound["weight"])
    spatial = input.dim() - 2
    stride, padding, dilation, output_padding = (
        _expanded(bound[name], spatial) for name in ("stride", "padding", "dilation", "output_padding")
    )
    if input.dim() != 3:
        return input, weight, Geometry(stride, padding, dilation, output_padding, bound["transposed"]), 0
    copy = contiguous_copy_bytes(input, torch.contiguous_format)
    geometry = Geometry([1, *stride], [0, *padding], [1, *dilation], [0, *output_padding], bound["transposed"])
    return input.contiguous().unsqueeze(2), weight.unsqueeze(2), geometry, copy


def _thnn_format(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """`thnn_conv_use_channels_last` (ConvUtils.h): channels-last where the input's or the weight's
    `suggest_memory_format()` is, which reads the strides' order (torch._prims_common.suggest_memory_format, its
    Python twin), not contiguity: a group's slice of a channels-last tensor with one channel per group, contiguous
    both ways, is channels-last there (measured: a two-group channels-last SlowTranspose2d backward holds no copy of
    its grad_output; memplan had counted one)."""
    formats = (prims_suggest_memory_format(input), prims_suggest_memory_format(weight))
    channels_last = torch.channels_last in formats
    return torch.channels_last if channels_last else torch.contiguous_format


def _backend_format(backend: str, input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """`determine_backend_memory_format` (Convolution.cpp): Slow2d, SlowDilated2d and SlowTranspose2d work
    channels-last where thnn_conv_use_channels_last says; the others (NnpackSpatial and the 3-D ones: measured, a
    channels-last-3d input to Slow3d is copied to the default format) in the default format."""
    if backend in (SLOW2D, SLOW_DILATED2D, SLOW_TRANSPOSE2D):
        return _thnn_format(input, weight)
    return torch.contiguous_format


def _bound_spatial(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor, Geometry, int] | None]:
    """The op's arguments by name, and its input, weight, geometry and a 1-D one's copy as `_as_spatial` gives them;
    None for a call without a strided 1-D, 2-D or 3-D input."""
    bound = bound_arguments(op, args, kwargs)
    input = bound["input"]
    if not isinstance(input, torch.Tensor) or input.dim() not in (3, 4, 5):
        return bound, None
    return bound, _as_spatial(bound)


@composite_kernel_scratch(_CONVOLUTION)
def slow_conv_forward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """A CPU convolution on one of ATen's backends (_cpu_backend), torch 2.11-2.14.

    `_convolution` (Convolution.cpp) makes the input and weight contiguous in the backend's format (_backend_format),
    then, with one group or on Slow3d (which takes the groups itself), calls the backend (convolution_backends.
    forward_bytes: Slow2d's im2col columns are allocated before its output and freed as it returns). With several
    groups on the others, each group's `subtensor` of the input and weight (a narrowed `.contiguous(format)`: a copy
    unless already contiguous) and what its backend holds are held beside the outputs of the groups before it, and
    `at::cat(outputs, 1)` makes the output while all of them are alive. Measured with torch.profiler (oneDNN off): a
    [2, 8, 16, 16] float32 input, 3x3 to 16 channels, holds 147,456 B beside its 32,768 B output; depthwise, 20,480 B
    beside 16,384 B; at a batch of 16 (NNPACK) a depthwise 7x7 over [16, 8, 32, 32] holds its 524,288 B output's worth
    of group outputs during the cat; transposed with two groups, 3x3 from 8 to 16 channels, 155,648 B."""
    if device != "cpu":
        return 0
    bound, spatial = _bound_spatial(_CONVOLUTION, args, kwargs)
    if spatial is None:
        return 0
    input, weight, geometry, held = spatial
    groups = bound["groups"]
    backend = _cpu_backend(input, weight, geometry, groups)
    if backend is None:
        return 0
    has_bias = isinstance(bound["bias"], torch.Tensor)
    memory_format = _backend_format(backend, input, weight)
    held += contiguous_copy_bytes(input, memory_format) + contiguous_copy_bytes(weight, memory_format)
    input, weight = input.contiguous(memory_format=memory_format), weight.contiguous(memory_format=memory_format)
    if groups == 1 or backend not in SPLITS_GROUPS:
        return held + forward_bytes(backend, input, weight, has_bias, geometry)
    input_g, weight_g = _subtensor(input, 1, groups, 0), _subtensor(weight, 0, groups, 0)
    copies = contiguous_copy_bytes(input_g, suggested_memory_format(input)) + contiguous_copy_bytes(
        weight_g, suggested_memory_format(weight)
    )
    input_g = input_g.contiguous(memory_format=suggested_memory_format(input))
    weight_g = weight_g.contiguous(memory_format=suggested_memory_format(weight))
    inner = forward_bytes(backend, input_g, weight_g, has_bias, geometry)
    # the last group: the groups' outputs (their storages: the output's bytes in all, or more where each is made in
    # an input-sized storage, output_storage_bytes) and its copies and scratch; then the cat beside them
    group_outputs = groups * output_storage_bytes(backend, input_g, weight_g, geometry)
    excess = group_outputs - output_bytes(input, weight, geometry, groups)
    return held + max(copies + inner + excess, group_outputs)


def _nogroup_backward_bytes(
    backend: str, grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, geometry: Geometry,
    mask: list[bool], device: str,
) -> int:  # fmt: skip
    """What the backend's backward holds for one group beside the three gradients, `input` and `weight` contiguous in
    its format; Slow2d's is slow_conv_backward_scratch's own."""
    memory_format = _backend_format(backend, input, weight)
    if backend in (NNPACK, SLOW_DILATED2D, SLOW_DILATED3D):
        return dilated_backward_bytes(grad_output, input, weight, geometry, mask, device, _thnn_format(input, weight))
    return transposed_or_3d_backward_bytes(backend, grad_output, input, weight, geometry, mask, device, memory_format)


@composite_kernel_scratch(_CONVOLUTION_BACKWARD)
def slow_conv_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The backward of a CPU convolution on one of ATen's backends (_cpu_backend), torch 2.11-2.14.

    `convolution_backward` (Convolution.cpp) makes the input and weight contiguous in the backend's format; with one
    group `_slow_conv2d_backward` (ConvolutionMM2d.cpp, Slow2d) computes the input's gradient from `grad_output.
    contiguous(format)` (its per-thread im2col buffer is `std::make_unique`, not the tensor allocator's), then the
    bias's, then the weight's from `grad_output.contiguous(format)` again and `compute_columns2d(input)`, both held
    beside the three gradients until it returns; the other backends hold what convolution_backends says. With several
    groups (not on Slow3d, which takes them itself), each group's `subtensor` of grad_output, input and weight (copies
    unless contiguous) and what its backward holds are held beside the gradients of the groups before it, and the
    `at::cat`s make the gradients while all the groups' are alive. Measured with torch.profiler (oneDNN off): 3x3
    over a [2, 8, 16, 16] float32 input to 16 channels, 147,456 B beside its gradients."""
    if device != "cpu":
        return 0
    bound, spatial = _bound_spatial(_CONVOLUTION_BACKWARD, args, kwargs)
    grad_output = bound["grad_output"]
    if not isinstance(grad_output, torch.Tensor) or spatial is None:
        return 0
    input, weight, geometry, held = spatial
    groups, mask = bound["groups"], bound["output_mask"]
    backend = _cpu_backend(input, weight, geometry, groups)
    if backend is None:
        return 0
    grad_output = meta_like(grad_output)
    if grad_output.dim() == 3:
        grad_output = grad_output.unsqueeze(2)
    memory_format = _backend_format(backend, input, weight)
    held += contiguous_copy_bytes(input, memory_format) + contiguous_copy_bytes(weight, memory_format)
    input, weight = input.contiguous(memory_format=memory_format), weight.contiguous(memory_format=memory_format)
    if (groups == 1 or backend not in SPLITS_GROUPS) and backend != SLOW2D:
        return held + _nogroup_backward_bytes(backend, grad_output, input, weight, geometry, mask, device)
    if groups == 1:
        grad_output_copy = contiguous_copy_bytes(grad_output, memory_format)
        columns = batch_columns_bytes(input, weight, geometry)
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
        columns = batch_columns_bytes(input_g, weight_g, geometry) if mask[1] else 0
        group = inner + columns if mask[0] or mask[1] else 0
    else:
        group = _nogroup_backward_bytes(backend, grad_output_g, input_g, weight_g, geometry, mask, device)
    gradients = (
        (_nbytes(input) if mask[0] else 0)
        + (_nbytes(weight) if mask[1] else 0)
        + (grad_output.shape[1] * grad_output.element_size() if mask[2] else 0)
    )
    return held + max(copies + group, gradients)


@output_bytes_rule(_CONVOLUTION)
def convolution_output_bytes(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    """The output's storage: on the CPU's SlowTranspose3d with one group, `at::empty_like(input)` resized to the
    output (NaiveConvolutionTranspose3d.cpp), never smaller than the input's (output_storage_bytes); otherwise its
    own size."""
    bound, spatial = _bound_spatial(_CONVOLUTION, args, kwargs)
    if spatial is None:
        output = torch.ops.aten.convolution.default(*(meta_like(a) if isinstance(a, torch.Tensor) else a for a in args))
        return [_nbytes(output)]
    input, weight, geometry, _ = spatial
    backend = _cpu_backend(input, weight, geometry, bound["groups"]) if device == "cpu" else None
    if backend == SLOW_TRANSPOSE3D and bound["groups"] == 1:
        return [output_storage_bytes(backend, input.contiguous(), weight.contiguous(), geometry)]
    return [output_bytes(input, weight, geometry, bound["groups"])]
