"""memplan.estimator.composite_kernels' rules for the CPU flash attention kernels: the per-thread scratch blocks
both directions allocate inside the kernel, and the backward's copy of a gradient that does not arrive in the
kernel's [batch, seq, heads, head_dim] layout (a per-sample buffer: without it the per-sample slope, and every
batch size's peak, came out low where attention's backward is the peak).

Truth: the step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's own events
(tests/hand_measure.py, torch.profiler). The profiler records the allocations of the calling thread only, so with
two intra-op threads it misses the other thread's `dsum` (qSplitSize floats), which memplan counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memplan.estimator import composite_kernels
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

SEQ, WIDTH, HEADS = 256, 64, 4  # 256 query positions: the kernels' 64-row query blocks
Q_SPLIT = 64


class _Attention(torch.nn.Module):
    """Self-attention whose loss sums either the kernel's output itself (its gradient a broadcast in the
    [batch, heads, seq, head_dim] layout: the backward copies it) or a projection of it taken as transformers
    does (the gradient a transposed view of [batch, seq, heads, head_dim]: no copy)."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.qkv, self.out, self.layout = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH), layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = self.qkv(x).view(batch, SEQ, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.layout == "heads-first":
            return attended.sum()
        return self.out(attended.transpose(1, 2).reshape(batch, SEQ, WIDTH)).sum()


def _plain_run_peak(layout: str, batch: int, threads: int) -> int:
    def build():
        torch.manual_seed(0)
        model = _Attention(layout)
        optimizer = torch.optim.AdamW(model.parameters())
        return training_iteration(model, torch.randn(batch, SEQ, WIDTH), lambda out, _: out, optimizer)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return profiled_third_iteration_peak(build)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("layout", "batch", "threads"),
    [("heads-first", 1, 1), ("heads-first", 3, 1), ("heads-first", 3, 2), ("transposed", 3, 1)],
)
def test_cpu_flash_attention_holds_its_kernel_s_scratch(layout, batch, threads, monkeypatch):
    monkeypatch.setattr(composite_kernels, "INTRA_OP_THREADS", threads)
    measured = _plain_run_peak(layout, batch, threads)
    spec = loss_returning_spec(f"attention-{layout}", lambda: _Attention(layout), (SEQ, WIDTH))
    simulation = simulate(trace_step(spec, TrainingSettings(batch_size=batch, device="cpu", optimizer="adamw")))
    assert simulation.peak_op == "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    unseen_dsums = (threads - 1) * Q_SPLIT * torch.float32.itemsize
    assert measured <= simulation.peak_bytes <= measured + unseen_dsums
