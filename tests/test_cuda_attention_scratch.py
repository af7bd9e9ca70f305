"""Scratch the CUDA attention backward kernels allocate besides their gradients, and where it goes.

The truths are byte counts written out here from the formulas of flash_api.cpp `mha_bwd`,
attention_backward.cu and kernel_backward.h (rounded shapes x 4 bytes), not computed by memplan.
"""

import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.cuda.attention_scratch import (
    EFFICIENT_BACKWARD,
    FLASH_BACKWARD,
    attention_backward_scratch,
    efficient_backward_scratch,
    flash_backward_scratch,
)
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings
from tests.module_specs import loss_returning_spec

H100, V100, P100 = (9, 0), (7, 0), (6, 0)


def _bshd_as_bhsd(batch: int, seq: int, heads: int, dim: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A [batch, heads, seq, dim] view of contiguous [batch, seq, heads, dim] storage, as flash makes it."""
    return torch.empty(batch, seq, heads, dim, dtype=dtype).transpose(1, 2)


def test_flash_backward_scratch_is_softmax_d_and_dq_accum_at_their_rounded_shapes() -> None:
    q, k, out, grad = (_bshd_as_bhsd(2, 100, 4, 64) for _ in range(4))
    # softmax_d: 2 x 4 x 128 (100 rounded to 128) floats; dq_accum: 2 x 128 x 4 x 64 (64 is a multiple of 32).
    assert flash_backward_scratch(grad, q, k, out) == (2 * 4 * 128 * 4, 2 * 128 * 4 * 64 * 4)
    # Head dim 72 rounds to 96 (multiple of 32 up to 128); 160 rounds to 192 (multiple of 64 above 128).
    q72 = _bshd_as_bhsd(1, 256, 2, 72)
    assert flash_backward_scratch(q72, q72, q72, q72)[1] == 1 * 256 * 2 * 96 * 4
    q160 = _bshd_as_bhsd(1, 129, 2, 160)
    assert flash_backward_scratch(q160, q160, q160, q160) == (1 * 2 * 256 * 4, 1 * 256 * 2 * 192 * 4)


def test_flash_backward_with_grouped_heads_expands_dk_and_dv_and_copies_what_is_not_contiguous() -> None:
    q, out = _bshd_as_bhsd(2, 128, 8, 64), _bshd_as_bhsd(2, 128, 8, 64)
    k = _bshd_as_bhsd(2, 300, 2, 64)  # 2 key/value heads for 8 query heads, 300 keys
    expanded = 2 * 300 * 8 * 64 * 2  # [batch, seq_k, heads, dim] in bf16, twice (dk and dv)
    assert flash_backward_scratch(out, q, k, out)[2:] == (expanded, expanded)
    # A grad_out laid out [batch, heads, seq, dim] (not transposable to a contiguous tensor): copied first.
    grad = torch.empty(2, 8, 128, 64, dtype=torch.bfloat16)
    assert flash_backward_scratch(grad, q, q, out)[0] == 2 * 8 * 128 * 64 * 2
    assert len(flash_backward_scratch(grad, q, q, out)) == 3


def test_efficient_backward_scratch_is_delta_and_the_grad_query_accumulator() -> None:
    q = torch.empty(2, 4, 100, 64, dtype=torch.float16)
    delta, accumulator = 2 * 4 * 100 * 4, 2 * 4 * 100 * 64 * 4
    assert efficient_backward_scratch(q, q, H100) == (delta, accumulator)
    assert efficient_backward_scratch(q, q, V100) == (delta, accumulator)
    assert efficient_backward_scratch(q, q, P100) == (delta,)  # no split keys before sm70
    # float32 computes delta outside the kernel: a product the size of grad_out, then its sum over dim.
    q32 = torch.empty(2, 4, 100, 8, dtype=torch.float32)
    kernel = (2 * 4 * 100 * 4, 2 * 4 * 100 * 8 * 4)
    assert efficient_backward_scratch(q32, q32, H100) == kernel  # the product and its sum are no larger
    assert efficient_backward_scratch(q32, q32, P100) == (2 * 4 * 100 * 8 * 4, 2 * 100 * 4 * 4)


def test_only_attention_backward_ops_have_scratch() -> None:
    q = _bshd_as_bhsd(1, 128, 2, 64)
    args = (q, q, q, q, q, torch.empty(1, 2, 128))
    assert attention_backward_scratch(FLASH_BACKWARD, args, H100) == (1 * 2 * 128 * 4, 1 * 128 * 2 * 64 * 4)
    assert attention_backward_scratch(EFFICIENT_BACKWARD, args, H100) != ()
    assert attention_backward_scratch(torch.ops.aten.mm.default, (q, q), H100) == ()


class _Attention(nn.Module):
    """One self-attention over a [batch, seq, heads * dim] input with projections, heads 4 x dim 64."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(256, 3 * 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, 4, 64).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, seq, 256).float().sum()


def _spec() -> ModelSpec:
    return loss_returning_spec("one-attention", _Attention, (200, 256))


def test_the_flash_backward_node_requests_its_scratch_after_its_gradients() -> None:
    settings = TrainingSettings(batch_size=2, optimizer="sgd", precision="amp-bf16", gpu="A100-80GB")
    simulation = simulate(trace_step(_spec(), settings))
    scratch = [a for a in simulation.timeline.allocations if "attention backward scratch" in a.op]
    assert [a.op for a in scratch] == ["flash attention backward scratch"] * 2
    # softmax_d 2 x 4 x 256 floats; dq_accum 2 x 256 x 4 x 64 floats (200 rounds to 256).
    assert [a.requested_bytes for a in scratch] == [2 * 4 * 256 * 4, 2 * 256 * 4 * 64 * 4]
    assert all(a.allocated_at == a.freed_at == scratch[0].allocated_at for a in scratch)
    same_node = [a for a in simulation.timeline.allocations if a.allocated_at == scratch[0].allocated_at]
    assert same_node[-2:] == scratch


def test_the_cudnn_backward_node_requests_the_workspace_measured_on_an_h100_after_its_gradients() -> None:
    """The lent H100 (cuDNN 9.19) requested, after dq/dk/dv, float32 [batch, heads, seq, head_dim]
    plus float32 [batch, heads, seq] plus 256 bytes: 51,118,336 bytes for GPT-2 at batch 16, 12
    heads, 1,024 tokens, head dim 64 (docs/validation/h100, gpt2-bf16's allocator trace)."""
    from memplan.estimator.cuda.attention_scratch import cudnn_backward_scratch

    gpt2 = torch.empty(16, 12, 1024, 64, dtype=torch.bfloat16)
    assert cudnn_backward_scratch(gpt2, gpt2) == (51_118_336,)
    # Qwen2.5-0.5B, batch 4: 14 query heads over 2 key/value heads requested 29,589,760 bytes.
    query, key = torch.empty(4, 14, 1024, 64, dtype=torch.bfloat16), torch.empty(4, 2, 1024, 64, dtype=torch.bfloat16)
    assert cudnn_backward_scratch(query, key) == (29_589_760,)
    settings = TrainingSettings(batch_size=2, optimizer="sgd", precision="amp-bf16", gpu="H100-80GB")
    simulation = simulate(trace_step(_spec(), settings))
    scratch = [a for a in simulation.timeline.allocations if "attention backward scratch" in a.op]
    assert [a.op for a in scratch] == ["cuDNN attention backward scratch"]
    assert [a.requested_bytes for a in scratch] == [2 * 4 * 200 * 64 * 4 + 2 * 4 * 200 * 4 + 256]
    same_node = [a for a in simulation.timeline.allocations if a.allocated_at == scratch[0].allocated_at]
    assert same_node[-1:] == scratch


def test_no_attention_scratch_on_the_cpu_or_for_the_math_kernel() -> None:
    for settings in (
        TrainingSettings(batch_size=2, optimizer="sgd", device="cpu"),
        TrainingSettings(batch_size=2, optimizer="sgd", precision="amp-bf16", gpu="T4"),  # no bf16 flash on sm75
    ):
        simulation = simulate(trace_step(_spec(), settings))
        assert not [a for a in simulation.timeline.allocations if "attention backward scratch" in a.op]


def test_each_scratch_request_reads_its_own_argument() -> None:
    q, k = _bshd_as_bhsd(1, 128, 2, 64), _bshd_as_bhsd(1, 128, 2, 64)
    out = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16)  # [batch, heads, seq, dim] storage: copied
    assert flash_backward_scratch(q, q, k, out)[0] == 1 * 2 * 128 * 64 * 2
    # Memory-efficient: query [1, 2, 100, 8] against 50 keys; float32 grad_out [1, 2, 100, 16]
    # (value head dim 16). On sm60 there is no accumulator: the delta product is the output's size.
    query, key = torch.empty(1, 2, 100, 8), torch.empty(1, 2, 50, 8)
    grad_out = torch.empty(1, 2, 100, 16)
    args = (grad_out, query, key, key, None, grad_out, torch.empty(1, 2, 100))
    assert attention_backward_scratch(EFFICIENT_BACKWARD, args, P100) == (1 * 2 * 100 * 16 * 4, 1 * 100 * 2 * 4)
    # On sm90 the kernel holds delta (800) and the accumulator (6,400): less than the product and its sum.
    assert attention_backward_scratch(EFFICIENT_BACKWARD, args, H100) == (1 * 2 * 100 * 16 * 4, 1 * 100 * 2 * 4)


def test_deterministic_flash_splits_dq_accum_over_the_multiprocessors() -> None:
    q = _bshd_as_bhsd(1, 128, 2, 64)
    one_split = 1 * 128 * 2 * 64 * 4
    # ceil(132 / (1 x 2)) = 66 splits on an H100; ceil(108 / 2) = 54 on an A100.
    assert flash_backward_scratch(q, q, q, q, deterministic_multiprocessors=132)[1] == 66 * one_split
    assert flash_backward_scratch(q, q, q, q, deterministic_multiprocessors=108)[1] == 54 * one_split
    wide = _bshd_as_bhsd(16, 128, 16, 64)  # 256 batch-heads >= 132: one split
    assert flash_backward_scratch(wide, wide, wide, wide, 132)[1] == 16 * 128 * 16 * 64 * 4
    settings = TrainingSettings(batch_size=2, optimizer="sgd", precision="amp-bf16", gpu="A100-80GB")
    deterministic = simulate(trace_step(_spec(), settings.replace(deterministic=True)))
    dq_accum = [a for a in deterministic.timeline.allocations if "attention backward scratch" in a.op][1]
    assert dq_accum.requested_bytes == -(-108 // (2 * 4)) * 2 * 256 * 4 * 64 * 4  # 14 splits


def test_the_memory_efficient_backward_node_names_its_scratch() -> None:
    """float32 attention runs the memory-efficient kernel on an H100 (flash takes 16-bit only): the
    timeline names its scratch for that kernel (the sizes: test_each_scratch_request_reads_its_own_argument)."""
    settings = TrainingSettings(batch_size=2, optimizer="sgd", gpu="H100-80GB")
    simulation = simulate(trace_step(_spec(), settings))
    scratch = [a for a in simulation.timeline.allocations if "attention backward scratch" in a.op]
    assert [a.op for a in scratch] == ["memory-efficient attention backward scratch"] * len(scratch)
    assert scratch
