"""Layer norm's saved statistics: the dtype its kernels give them, which torch's fake kernel gets wrong.

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

from memplan.estimator.oprules import output_bytes_rule

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
