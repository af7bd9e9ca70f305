"""Norms' saved statistics (and group norm's input gradient): the dtypes their kernels give them, which torch's
fake kernels get wrong.

`native_layer_norm` returns the output, and the mean and reciprocal standard deviation of each row,
which autograd saves for the backward. Their dtype:
- CUDA: the accumulate type of the input's, float32 for a float16 or bfloat16 input
  (aten/src/ATen/native/cuda/layer_norm_kernel.cu, layer_norm_cuda: `at::empty({M},
  X->options().dtype(acc_type))`, `acc_type = at::toAccumulateType(input.scalar_type(), /*is_cuda=*/true)`).
- CPU: the parameters' type where input and parameters differ (a 16-bit input with float32 weights:
  `is_mixed_type`, `param_scalar_type` in aten/src/ATen/native/layer_norm.cpp), the input's otherwise.
torch's fake kernel (torch/_refs/__init__.py, native_layer_norm) gives a CPU tensor's statistics the input's
dtype, and memplan's fake tensors are CPU tensors for both targets: a 16-bit model's norms on a cuda target,
and a float16 input with float32 weights on the cpu target (CPU autocast in float16 runs layer norm in the
input's dtype), have statistics twice the bytes the fake kernel says.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from memplan.estimator.memory_formats import (
    contiguous_in_a_format,
    empty_like_format,
    prims_suggest_memory_format,
    suggested_memory_format,
)
from memplan.estimator.oprules import CONTIGUOUS_OUTPUTS, output_bytes_rule, output_dtypes_rule, output_formats_rule

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def statistics_dtype(input_dtype: torch.dtype, weight_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """The dtype of native_layer_norm's mean and rstd (module docstring)."""
    if input_dtype not in _SIXTEEN_BIT:
        return input_dtype
    if device == "cuda":
        return torch.float32
    return weight_dtype if weight_dtype is not None and weight_dtype != input_dtype else input_dtype


@output_bytes_rule(torch.ops.aten.native_layer_norm.default)
def native_layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    input, normalized_shape, weight = args[0], args[1], args[2]
    rows = math.prod(input.shape[: input.ndim - len(normalized_shape)])
    statistics = rows * statistics_dtype(input.dtype, weight.dtype if weight is not None else None, device).itemsize
    return [input.numel() * input.dtype.itemsize, statistics, statistics]


def _mixed(input: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """ATen's `is_mixed_type` (aten/src/ATen/native/mixed_dtypes.h): a 16-bit input with float32 parameters."""
    return input.dtype in _SIXTEEN_BIT and any(param is not None and param.dtype == torch.float32 for param in params)


@output_dtypes_rule(torch.ops.aten.native_group_norm.default)
def native_group_norm(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[Any, ...]:
    """Mean and rstd in `param_scalar_type(X, mixed_type)`: float32 for a 16-bit input with float32 weights, the
    input's dtype otherwise, on every device (aten/src/ATen/native/group_norm.cpp, native_group_norm, before it
    dispatches to the device's kernel). torch's fake kernel gives them the input's dtype: a bfloat16 input under CPU
    autocast, whose GroupNorm keeps float32 weights, had statistics half their size."""
    input, weight, bias = args[0], args[1], args[2]
    statistics = torch.float32 if _mixed(input, weight, bias) else input.dtype
    return (None, statistics, statistics)


@output_dtypes_rule(torch.ops.aten.native_group_norm_backward.default)
def native_group_norm_backward(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[Any, ...]:
    """The input's gradient in the input's dtype (group_norm.cpp, native_group_norm_backward: `dX =
    at::native::empty_like(X)`). torch's fake kernel computes it in the promoted dtype, float32 for a bfloat16
    input with float32 statistics, and autograd then cast it back: a copy the real run does not make, and an input
    gradient twice its size (a GroupNorm step under CPU autocast predicted 22% high)."""
    return (args[1].dtype, None, None)


@output_dtypes_rule(torch.ops.aten.native_batch_norm.default)
def native_batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[Any, ...]:
    """save_mean and save_invstd: on CUDA in the input's accumulate type, float32 for a 16-bit input
    (aten/src/ATen/native/cuda/Normalization.cu, batch_norm_cuda; cuDNN's batch norm, which a GPU runs for
    it, keeps them in float32 too); on the CPU in `param_scalar_type(self, mixed_type)` (Normalization.cpp,
    batch_norm_cpu). torch's fake kernel gives them the input's dtype. InstanceNorm runs this op on a (1, N·C, ...)
    view, so its statistics grow with the batch."""
    input, weight, bias = args[0], args[1], args[2]
    if input.dtype not in _SIXTEEN_BIT:
        return (None, None, None)
    statistics = torch.float32 if device == "cuda" or _mixed(input, weight, bias, args[3], args[4]) else input.dtype
    return (None, statistics, statistics)


# The input gradient of layer and group norm is made like the (contiguous) input, `at::native::empty_like(*X, ...,
# LEGACY_CONTIGUOUS_MEMORY_FORMAT)` with `X = input.expect_contiguous()` (layer_norm.cpp, layer_norm_backward_cpu;
# cuda/layer_norm_kernel.cu, layer_norm_backward_cuda; group_norm.cpp, native_group_norm_backward), where torch's fake
# kernels copy the incoming gradient's strides: a transposed gradient (Swin's windows) came out transposed and the
# next view copied it, 32,768 B the real run does not allocate: a tiny Swin (transformers' SwinForImageClassification,
# batch 4) was 4,479,360 B predicted against 4,446,596 measured on the CPU, 4,446,592 with this (a helper's bug hunt;
# the kernels' layout is checked in tests/test_oprules_norms.py).
CONTIGUOUS_OUTPUTS[torch.ops.aten.native_layer_norm_backward.default] = frozenset({0})
CONTIGUOUS_OUTPUTS[torch.ops.aten.native_group_norm_backward.default] = frozenset({0})


_BATCH_NORMS = (
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit.no_stats,
    torch.ops.aten._native_batch_norm_legit_no_training.default,
)


@output_formats_rule(*_BATCH_NORMS)
def batch_norm_output_format(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[Any, ...]:
    """The CPU batch norm makes its output `at::empty_like(self, all_contiguous ? suggest_memory_format_contig(self) :
    self.suggest_memory_format())` (aten/src/ATen/native/Normalization.cpp, batch_norm_cpu, torch 2.11-2.14): in the
    input's own format where it is contiguous in one, else in its suggested format, the default one for an input
    neither contiguous nor channels-last (a `(N, L, C)` activation moved to `(N, C, L)` for a BatchNorm1d). torch's
    fake kernel keeps such an input's strides, so that the next `movedim` back looked contiguous where the real one
    is not, and the matmul after it copied nothing: a BatchNorm1d between two such projections was an input-sized
    3,584 B (8%) low (tests/test_oprules_norms.py). The cpu target only: CUDA's kernels are not this code."""
    if device != "cpu":
        return (None, None, None)
    return (empty_like_format(args[0]), None, None)


@output_formats_rule(torch.ops.aten.native_batch_norm_backward.default)
def batch_norm_backward_format(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[Any, ...]:
    """The input's gradient, `at::empty_like(input, all_contiguous ? suggest_memory_format_contig(input) :
    input.suggest_memory_format())` (Normalization.cpp, batch_norm_backward_cpu_template, torch 2.11-2.14), where
    `all_contiguous` is input and incoming gradient each contiguous in a format and suggesting the same one: a
    [N, C, 1, 1] input with channels-last strides (contiguous both ways, its strides' order channels-last) and a
    gradient with the default strides suggest two formats, and the gradient comes out channels-last. torch's fake
    kernel follows the incoming gradient's strides. Checked against the kernel for every pair of layouts in
    tests/test_oprules_norms.py."""
    if device != "cpu":
        return (None, None, None)
    grad_output, input = args[0], args[1]
    all_contiguous = (
        contiguous_in_a_format(input)
        and contiguous_in_a_format(grad_output)
        and prims_suggest_memory_format(input) == prims_suggest_memory_format(grad_output)
    )
    return (suggested_memory_format(input) if all_contiguous else prims_suggest_memory_format(input), None, None)
