"""What each of ATen's CPU convolution backends without oneDNN holds inside one call for one group, beside the
tensors it returns: im2col (vol2col) columns, a bias's ones or sums, the contiguous copies it makes itself. Called by
memplan.estimator.composite_kernels.convolution, which chooses the backend (`_select_conv_backend`, Convolution.cpp)
and splits the groups; `input` and `weight` here are already contiguous in the backend's format, a 1-D convolution
viewed as a 2-D one.

The 2-D backends' rules come from their sources (ConvolutionMM2d.cpp, NNPACK.cpp, NaiveDilatedConvolution.cpp). For
the transposed and 3-D ones (NaiveConvolutionTranspose2d.cpp, NaiveConvolutionTranspose3d.cpp, ConvolutionMM3d.cpp)
the sources available here predate torch 2.11, so each rule is the structure those files have, checked call by call
against torch.profiler's memory events on torch 2.13 with oneDNN off (tests/test_cpu_convolution.py measures every
case named below)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memplan.estimator import composite_kernels
from memplan.estimator.composite_kernels import _nbytes, contiguous_copy_bytes

SLOW2D, NNPACK, SLOW_DILATED2D = "Slow2d", "NnpackSpatial", "SlowDilated2d"
SLOW_TRANSPOSE2D, SLOW_TRANSPOSE3D = "SlowTranspose2d", "SlowTranspose3d"
SLOW3D, SLOW_DILATED3D = "Slow3d", "SlowDilated3d"
# `convolution` and `convolution_backward` (Convolution.cpp) run these group by group ("Handle backends that don't
# natively support groups > 1"); Slow3d takes the groups itself (`slow_conv3d_forward_out_cpu` reads them off the
# weight), with columns over all the input's channels.
SPLITS_GROUPS = frozenset({SLOW2D, NNPACK, SLOW_DILATED2D, SLOW_TRANSPOSE2D, SLOW_DILATED3D, SLOW_TRANSPOSE3D})

_SUM = torch.ops.aten.sum.dim_IntList


@dataclass(frozen=True)
class Geometry:
    """A convolution's stride, padding, dilation and output padding, one value per spatial dimension."""

    stride: list[int]
    padding: list[int]
    dilation: list[int]
    output_padding: list[int]
    transposed: bool

    def pointwise(self, weight: torch.Tensor) -> bool:
        """A 1x1 kernel at stride 1 without padding or dilation, whose columns are the input itself."""
        return (
            all(k == 1 for k in weight.shape[2:])
            and all(s == 1 for s in self.stride)
            and all(p == 0 for p in self.padding)
            and all(d == 1 for d in self.dilation)
        )


def output_spatial(input: torch.Tensor, weight: torch.Tensor, geometry: Geometry) -> list[int]:
    """The output's spatial sizes: `conv_output_size` (ConvUtils.h), or for a transposed convolution
    `conv_input_size`'s `(i - 1) * s - 2 * p + d * (k - 1) + output_padding + 1`."""
    sizes = []
    for i, (size, kernel) in enumerate(zip(input.shape[2:], weight.shape[2:], strict=True)):
        s, p, d = geometry.stride[i], geometry.padding[i], geometry.dilation[i]
        if geometry.transposed:
            sizes.append((size - 1) * s - 2 * p + d * (kernel - 1) + geometry.output_padding[i] + 1)
        else:
            sizes.append((size + 2 * p - d * (kernel - 1) - 1) // s + 1)
    return sizes


def output_bytes(input: torch.Tensor, weight: torch.Tensor, geometry: Geometry, groups: int) -> int:
    """The whole output's bytes (all groups'): a transposed weight is [in, out / groups, k...]."""
    channels = weight.shape[1] * groups if geometry.transposed else weight.shape[0]
    return input.shape[0] * channels * math.prod(output_spatial(input, weight, geometry)) * input.element_size()


def _kernel_area(weight: torch.Tensor) -> int:
    return math.prod(weight.shape[2:])


def _sample_columns_bytes(input: torch.Tensor, weight: torch.Tensor, geometry: Geometry) -> int:
    """`slow_conv_dilated_all_cpu_template` (aten/src/ATen/native/NaiveDilatedConvolution.cpp, 2-D and 3-D): one
    sample's columns, `columns.resize_({nInputPlane * kernel area, output area})` (transposed for channels-last),
    reused for every sample and held until it returns; a 1x1 kernel's too (no view of the input, as Slow2d's)."""
    area = math.prod(output_spatial(input, weight, geometry))
    return weight.shape[1] * _kernel_area(weight) * area * input.element_size()


def batch_columns_bytes(input: torch.Tensor, weight: torch.Tensor, geometry: Geometry) -> int:
    """`compute_columns2d` (ConvolutionMM2d.cpp) and `compute_columns3d` (ConvolutionMM3d.cpp): the whole batch's
    columns, `at::empty({batch, channels * kernel area, output area})` in either memory format (3-D: all the input's
    channels, whatever the groups), except a pointwise kernel's with one group, whose columns view the input."""
    if geometry.pointwise(weight) and input.shape[1] == weight.shape[1]:
        return 0  # (one group: Slow3d's grouped calls make columns even for a pointwise kernel, measured)
    area = math.prod(output_spatial(input, weight, geometry))
    return input.shape[0] * input.shape[1] * _kernel_area(weight) * area * input.element_size()


def _transposed_columns_bytes(input: torch.Tensor, weight: torch.Tensor, samples: int) -> int:
    """A transposed convolution's columns, `{out channels * kernel area, input area}` per sample (its GEMM from the
    input into them, col2im from them into the output): `samples` samples' worth."""
    area = math.prod(input.shape[2:])
    return samples * weight.shape[1] * _kernel_area(weight) * area * input.element_size()


def forward_bytes(backend: str, input: torch.Tensor, weight: torch.Tensor, has_bias: bool, geometry: Geometry) -> int:
    """What the backend's forward holds beside its output:
    - Slow2d, `slow_conv2d_forward_out_cpu` (ConvolutionMM2d.cpp), and Slow3d, `slow_conv3d_forward_out_cpu`
      (ConvolutionMM3d.cpp): the whole batch's columns, allocated before the output and freed as it returns;
    - NnpackSpatial, `_nnpack_spatial_convolution` (NNPACK.cpp): `at::zeros({weight.size(0)})` for a missing bias
      (its workspace is `posix_memalign`ed, thread-local and kept, never the tensor allocator's);
    - SlowDilated2d and SlowDilated3d, `slow_conv_dilated{2,3}d_cpu` (NaiveDilatedConvolution.cpp): one sample's
      columns;
    - SlowTranspose2d, `slow_conv_transpose2d_out_cpu_template`: the whole batch's columns, a pointwise kernel's too
      (measured: [2, 8, 16, 16] into 16 channels, 3x3, holds 294,912 B beside its output; 1x1, 32,768 B);
    - SlowTranspose3d, `slow_conv_transpose3d_out_cpu_template`: one sample's columns, and with a bias its `ones`
      over the output's area (measured: [2, 4, 8, 8, 8] into 8 channels, 3x3x3 with a bias, 444,416 B); or, where
      the output outgrows the input-sized storage it is made in (output_storage_bytes), that storage as it is
      resized, if more (a reviewer's find: a float64 [2, 3, 8, 8, 8] pointwise at stride 2 holds 24,576 B)."""
    if backend in (SLOW2D, SLOW3D):
        return batch_columns_bytes(input, weight, geometry)
    if backend == NNPACK:
        return 0 if has_bias else weight.shape[0] * input.element_size()
    if backend == SLOW_TRANSPOSE2D:
        return _transposed_columns_bytes(input, weight, input.shape[0])
    if backend == SLOW_TRANSPOSE3D:
        ones = math.prod(output_spatial(input, weight, geometry)) * input.element_size() if has_bias else 0
        # its output is `empty_like(input)` resized: grown, the input-sized storage is held a moment beside the new
        grown = _nbytes(input) if output_bytes(input, weight, geometry, 1) > _nbytes(input) else 0
        return max(grown, _transposed_columns_bytes(input, weight, 1) + ones)
    return _sample_columns_bytes(input, weight, geometry)


def output_storage_bytes(backend: str, input: torch.Tensor, weight: torch.Tensor, geometry: Geometry) -> int:
    """The storage of one group's output: SlowTranspose3d makes it `at::empty_like(input)` and `resize_`s it (measured:
    a [2, 8, 8, 8, 8] input into 2 channels, 1x1x1, keeps its 32,768 B storage under an 8,192 B output), a storage
    never smaller than the input's; the others an output of its own size."""
    output = output_bytes(input, weight, geometry, 1)
    return max(output, _nbytes(input)) if backend == SLOW_TRANSPOSE3D else output


def _bias_sum_bytes(grad_output: torch.Tensor, dims: list[int], device: str) -> int:
    """What `grad_output.sum(dims)` holds for the bias's gradient beside it (a 16-bit one sums a float32 copy:
    reductions.sum_float_buffer_bytes)."""
    return composite_kernels.kernel_scratch_bytes(_SUM, (grad_output, dims), {}, device)


def dilated_backward_bytes(
    grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, geometry: Geometry,
    mask: list[bool], device: str, memory_format: torch.memory_format,
) -> int:  # fmt: skip
    """`slow_conv_dilated{2,3}d_backward_cpu` (aten/src/ATen/native/NaiveDilatedConvolution.cpp), the backward of
    NnpackSpatial ("nnpack backward does not support strided convolutions; use slow impl instead",
    `_convolution_backward_nogroup_backend`), SlowDilated2d and SlowDilated3d: `grad_output.contiguous(format)`, the
    three gradients (the op's), then in `slow_conv_dilated_all_cpu_template` one sample's columns (where the input's
    or the weight's gradient is wanted) and, per sample, the bias's `grad_bias += grad_output_n.sum(dims)`, whose
    [out_channels] sum is held beside them a moment. Measured with torch.profiler (oneDNN off, a batch of 16,
    32x32): a 1x1 from 32 to 8 channels holds 131,072 B of columns and 32 B of sum."""
    held = contiguous_copy_bytes(grad_output, memory_format)
    columns = _sample_columns_bytes(input, weight, geometry) if mask[0] or mask[1] else 0
    if not mask[2]:
        return held + columns
    sample = grad_output.contiguous(memory_format=memory_format)[0]
    bias_sum = weight.shape[0] * grad_output.element_size() + _bias_sum_bytes(
        sample, list(range(1, sample.dim())), device
    )
    return held + columns + bias_sum


def transposed_or_3d_backward_bytes(
    backend: str, grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, geometry: Geometry,
    mask: list[bool], device: str, memory_format: torch.memory_format,
) -> int:  # fmt: skip
    """What SlowTranspose2d's, Slow3d's and SlowTranspose3d's backwards hold beside the three gradients, `grad_output`
    made contiguous in the backend's format first (held throughout):
    - SlowTranspose2d (`slow_conv_transpose2d_backward_out_cpu_template`, then its `acc_grad_parameters`) and Slow3d
      (`slow_conv3d_backward_out_cpu_template`, then `slow_conv3d_backward_parameters_out_cpu_template`) run in three
      stages: the input's gradient from columns made for it while only that gradient exists (SlowTranspose2d: one
      sample's, none for a pointwise kernel; Slow3d: the whole batch's `fgrad_input`, a pointwise kernel's too), the
      bias's `grad_output.sum` before the weight's gradient is allocated, then the weight's gradient from columns
      held beside all three (SlowTranspose2d: one sample's; Slow3d: the whole batch's, none for a pointwise kernel).
      Measured (oneDNN off), with their gradients: [2, 8, 16, 16] transposed 3x3 into 16 channels holds 147,456 B;
      Slow3d over [2, 4, 8, 8, 8] 1x1x1 into 8 channels 16,224 B (the input-gradient stage), in bfloat16 32,736 B
      (the bias stage's float32 copy);
    - SlowTranspose3d (`slow_conv_transpose3d_backward_out_cpu_template` and `acc_grad_parameters`): one sample's
      columns whatever is wanted (none for a pointwise kernel), with the bias's sum beside them and all three
      gradients ([2, 4, 8, 8, 8] 3x3x3 into 8 channels: 442,368 B, in bfloat16 253,984 B)."""
    held = contiguous_copy_bytes(grad_output, memory_format)
    grad_output = grad_output.contiguous(memory_format=memory_format)
    pointwise = geometry.pointwise(weight)
    bias_sum = _bias_sum_bytes(grad_output, [0, *range(2, grad_output.dim())], device) if mask[2] else 0
    if backend == SLOW_TRANSPOSE3D:
        return held + (0 if pointwise else _transposed_columns_bytes(input, weight, 1)) + bias_sum
    element = input.element_size()
    weight_grad = math.prod(weight.shape) * element if mask[1] else 0
    bias_grad = grad_output.shape[1] * element if mask[2] else 0
    if backend == SLOW3D:
        area = math.prod(output_spatial(input, weight, geometry))
        input_columns = input.shape[0] * input.shape[1] * _kernel_area(weight) * area * element
        weight_columns = batch_columns_bytes(input, weight, geometry)
    else:  # SlowTranspose2d
        input_columns = weight_columns = 0 if pointwise else _transposed_columns_bytes(input, weight, 1)
    stages = (
        input_columns - weight_grad - bias_grad if mask[0] else 0,
        bias_sum - weight_grad if mask[2] else 0,
        weight_columns if mask[1] else 0,
    )
    return held + max(0, *stages)
