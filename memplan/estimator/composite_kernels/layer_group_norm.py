"""The temporaries the CPU layer norm and group norm kernels hold inside themselves (aten/src/ATen/native/
layer_norm.cpp, group_norm.cpp, cpu/layer_norm_kernel.cpp, cpu/group_norm_kernel.cpp, torch 2.13), which no
dispatch mode sees. Measured with torch.profiler's allocator events on torch 2.13 CPU
(tests/test_layer_group_norm_scratch.py). CUDA's layer norm makes the same contiguous copies (modelled here
for both devices); CUDA's group norm kernels are other code: 0 there.

Not here: `rms_norm` (torch 2.13's CPU `_fused_rms_norm` is CompositeImplicit: plain ops the trace sees),
`instance_norm` (batch norm on a reshaped input: composite_kernels.batch_norm), `local_response_norm` and
`F.normalize` (plain ops).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from memplan.estimator import composite_kernels
from memplan.estimator.composite_kernels import _nbytes, bound_arguments, composite_kernel_scratch, opmath_dtype
from memplan.estimator.memory_formats import empty_like_format

# group_norm_kernel.cpp's `feature_map_threshold`: at or above this many elements an image, the channels-last
# kernels reduce through a per-thread buffer instead of one pass per (sample, group)
_CL_FORWARD_THRESHOLD, _CL_BACKWARD_THRESHOLD = 1024, 2048


def _contiguous_copy_requests(*tensors: Any) -> tuple[int, ...]:
    """What `expect_contiguous()` / `.contiguous()` copy: each defined tensor not contiguous in the default format,
    whole, one request a copy (each is its own allocation: rounded apart on cuda)."""
    return tuple(_nbytes(t) for t in tensors if isinstance(t, torch.Tensor) and not t.is_contiguous())


@composite_kernel_scratch(torch.ops.aten.native_layer_norm.default)
def layer_norm_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int | tuple[int, ...]:
    """`layer_norm_cpu` (layer_norm.cpp) reads `input.expect_contiguous()`, `weight.expect_contiguous()` and
    `bias.expect_contiguous()`: a whole copy of each one that is not contiguous, held while the kernel writes the
    outputs; the forward kernel itself allocates nothing. CUDA's `layer_norm_cuda` (cuda/layer_norm_kernel.cu,
    torch 2.11-2.14) begins with the same three `expect_contiguous()` calls and its kernel allocates nothing either
    (ConvNeXt's LayerNorm of a permuted NCHW->NHWC activation copies it there too): on cuda each copy is its own
    caching-allocator request."""
    b = bound_arguments(torch.ops.aten.native_layer_norm.default, args, kwargs)
    copies = _contiguous_copy_requests(b["input"], b["weight"], b["bias"])
    return copies if device != "cpu" else sum(copies)


@composite_kernel_scratch(torch.ops.aten.native_layer_norm_backward.default)
def layer_norm_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int | tuple[int, ...]:
    """`layer_norm_backward_cpu` (layer_norm.cpp) copies a non-contiguous input, weight or bias
    (`expect_contiguous`); its kernel (LayerNormBackwardKernelImpl) then runs on `dY.contiguous()` (a whole copy of
    a transposed or expanded gradient, as a `sum` over the normalized rows hands back) and, where dgamma or dbeta
    is asked for, `buffer.resize_({2, num_threads, N}).zero_()` in the input's dtype (per-thread dgamma and dbeta
    rows, a 16-bit input's too, float32 weight or not); all held at once beside the three outputs.

    CUDA's `layer_norm_backward_cuda` (cuda/layer_norm_kernel.cu, torch 2.11-2.14) makes the same three
    `expect_contiguous()` copies and, where M > 0 and N > 0, calls LayerNormBackwardKernelImpl on `dY.contiguous()`
    as the CPU does; it has no per-thread buffer (its partial sums for a tall input are memplan.estimator.cuda.
    layer_norm_backward's, sized by the GPU's multiprocessors). Each copy is its own request there."""
    b = bound_arguments(torch.ops.aten.native_layer_norm_backward.default, args, kwargs)
    grad_out, input, normalized_shape = b["grad_out"], b["input"], b["normalized_shape"]
    mask = b["output_mask"]
    copies = _contiguous_copy_requests(input, b["weight"], b["bias"])
    if device != "cpu":
        runs = input.numel() > 0 and math.prod(normalized_shape) > 0  # `if (M > 0 && N > 0)`
        return copies + (_contiguous_copy_requests(grad_out) if runs else ())
    rows = input.numel() // max(math.prod(normalized_shape), 1)
    if rows == 0:  # M == 0: the kernel does not run
        return sum(copies)
    normalized = math.prod(normalized_shape)
    buffer = 2 * composite_kernels.INTRA_OP_THREADS * normalized * input.element_size() if mask[1] or mask[2] else 0
    return sum(copies) + sum(_contiguous_copy_requests(grad_out)) + buffer


def _channels_last(input: torch.Tensor) -> bool:
    """Whether the group norm kernels run their channels-last code (`X.suggest_memory_format()`)."""
    return empty_like_format(input) in (torch.channels_last, torch.channels_last_3d)


def _per_thread_buffers(input: torch.Tensor, groups: int) -> int:
    """The channels-last kernels' per-thread path: `at::zeros({num_threads, N, 2 * C})` and `at::empty({N, 2 * G})`,
    in the opmath dtype."""
    n, c = input.shape[0], input.shape[1]
    return (composite_kernels.INTRA_OP_THREADS * n * 2 * c + n * 2 * groups) * opmath_dtype(input.dtype).itemsize


@composite_kernel_scratch(torch.ops.aten.native_group_norm.default)
def group_norm_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`native_group_norm` (torch 2.13 requires the input contiguous in its memory format: no copy). The contiguous
    kernel allocates nothing; the channels-last one (GroupNormKernelImplChannelsLastInternal) holds each (sample,
    group)'s scale and bias, `at::empty({N * G, 2 * D})` in the opmath dtype (`N * 2C` elements), below
    `feature_map_threshold` (1024) elements an image, and _per_thread_buffers at or above it."""
    input = args[0]
    if device != "cpu" or input.numel() == 0 or not _channels_last(input):
        return 0
    b = bound_arguments(torch.ops.aten.native_group_norm.default, args, kwargs)
    n, c, hxw, groups = b["N"], b["C"], b["HxW"], b["group"]
    if hxw < _CL_FORWARD_THRESHOLD:
        return n * 2 * c * opmath_dtype(input.dtype).itemsize
    return _per_thread_buffers(input, groups)


@composite_kernel_scratch(torch.ops.aten.native_group_norm_backward.default)
def group_norm_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`native_group_norm_backward`'s kernels (GroupNormBackwardKernelImplInternal and its channels-last twin) hold
    the internal gradients `ds` and `db`, `at::empty({N, C})` each in the opmath dtype, until they return; the
    channels-last one adds _per_thread_buffers at or above `feature_map_threshold` (2048) elements an image. N == 0
    returns zeros without the kernel."""
    input = args[1]
    if device != "cpu" or input.numel() == 0:
        return 0
    b = bound_arguments(torch.ops.aten.native_group_norm_backward.default, args, kwargs)
    n, c, hxw, groups = b["N"], b["C"], b["HxW"], b["group"]
    internal = 2 * n * c * opmath_dtype(input.dtype).itemsize
    if _channels_last(input) and hxw >= _CL_BACKWARD_THRESHOLD:
        return internal + _per_thread_buffers(input, groups)
    return internal
