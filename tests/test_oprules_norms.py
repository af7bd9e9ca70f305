"""memplan.estimator.oprules.norms: layer norm's saved mean and rstd, sized as the kernels size them.

Truth: the CPU kernel itself, run on real tensors; for CUDA, layer_norm_kernel.cu's rule written out by hand
(float32 statistics for a 16-bit input), since this machine has no GPU."""

from __future__ import annotations

import pytest
import torch

import memplan
from memplan.estimator.oprules import OUTPUT_BYTES_RULES

LAYER_NORM = torch.ops.aten.native_layer_norm.default
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("input_dtype", "weight_dtype"),
    [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F32), (F16, None), (F16, F16)],
)
def test_on_the_cpu_target_the_statistics_are_the_cpu_kernel_s(input_dtype, weight_dtype):
    x = torch.randn(3, 5, 8).to(input_dtype)
    weight = torch.ones(8, dtype=weight_dtype) if weight_dtype is not None else None
    bias = torch.zeros(8, dtype=weight_dtype) if weight_dtype is not None else None
    real = LAYER_NORM(x, [8], weight, bias, 1e-5)
    rule = OUTPUT_BYTES_RULES[LAYER_NORM]((x, [8], weight, bias, 1e-5), {}, "cpu")
    assert rule == [tensor.untyped_storage().nbytes() for tensor in real]


@pytest.mark.parametrize(
    ("input_dtype", "weight_dtype", "statistic_bytes"),
    [(BF16, BF16, 4), (F16, None, 4), (F16, F32, 4), (F32, F32, 4), (torch.float64, torch.float64, 8)],
)
def test_on_the_cuda_target_a_16_bit_input_has_float32_statistics(input_dtype, weight_dtype, statistic_bytes):
    x = torch.empty(3, 5, 8, dtype=input_dtype)
    weight = torch.empty(8, dtype=weight_dtype) if weight_dtype is not None else None
    rule = OUTPUT_BYTES_RULES[LAYER_NORM]((x, [5, 8], weight, None, 1e-5), {}, "cuda")
    assert rule == [3 * 5 * 8 * x.element_size(), 3 * statistic_bytes, 3 * statistic_bytes]


def test_a_bf16_model_s_norms_on_a_cuda_target_save_float32_statistics():
    """End to end: tiny-gpt2 stored in bf16 on a cuda target, each layer norm's mean and rstd requested as
    batch × sequence float32 values (the fake kernel says bfloat16, half of it)."""
    result = memplan.estimate("tiny-gpt2", batch_size=4, seq_len=64, precision="bf16", gpu="A10G")
    norms = [
        allocation
        for allocation in result.timeline.allocations
        if allocation.op == "aten.native_layer_norm.default" and allocation.size_bytes < 4 * 64 * 2 * 8
    ]
    assert norms and {allocation.requested_bytes or allocation.size_bytes for allocation in norms} == {4 * 64 * 4}
