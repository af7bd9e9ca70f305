"""memplan.estimator.composite_kernels.scatter_gather: the CPU gather and scatter kernels' float32 copy of a float16 or
bfloat16 tensor they write (`create_acc_buffer`), the GNN fast path's per-thread rows instead, and a scatter_reduce
mean's counting, none of which a dispatch mode sees.

Truth: each call run for real on the CPU, measured by the CPU allocator's own events (torch.profiler:
tests/hand_measure.py), and a bfloat16 step whose peak is a gather's gradient (DeBERTa-v2's disentangled attention in
small). Before the rules every 16-bit case here was low by the buffer (0 predicted for each; the step 14.9% low)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.composite_kernels.scatter_gather import _radix_sort_with_openmp
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import held_beside_outputs, profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

aten = torch.ops.aten
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _calls(dtype: torch.dtype) -> dict[str, tuple[object, tuple, dict]]:
    """(op, args, kwargs) by name: attention-like [heads, queries, keys] scores gathered along the last dimension as
    DeBERTa-v2 does, their gradients scatter-added, and the dim-0 row gathers and scatters of the GNN fast path."""
    torch.manual_seed(0)
    scores, index = torch.randn(8, 32, 64, dtype=dtype), torch.randint(0, 64, (8, 32, 32))
    grads, zeros = torch.randn(8, 32, 32, dtype=dtype), torch.zeros(8, 32, 64, dtype=dtype)
    rows = torch.randint(0, 10, (6, 1))
    wide_rows, narrow_rows = rows.expand(6, 32), rows.expand(6, 4)  # 32 and 4 elements per index row
    table, narrow_table = torch.zeros(10, 32, dtype=dtype), torch.zeros(10, 4, dtype=dtype)
    sources, narrow_sources = torch.randn(6, 32, dtype=dtype), torch.randn(6, 4, dtype=dtype)
    return {
        "gather": (aten.gather.default, (scores, -1, index), {}),
        "gather-rows": (aten.gather.default, (table, 0, wide_rows), {}),
        "scatter_add_": (aten.scatter_add_.default, (zeros.clone(), -1, index, grads), {}),
        "scatter_add": (aten.scatter_add.default, (zeros, -1, index, grads), {}),
        "scatter_add_-rows": (aten.scatter_add_.default, (table.clone(), 0, wide_rows, sources), {}),
        "scatter_add_-narrow-rows": (
            aten.scatter_add_.default, (narrow_table.clone(), 0, narrow_rows, narrow_sources), {},
        ),
        "scatter_-src": (aten.scatter_.src, (zeros.clone(), -1, index, grads), {}),
        "scatter-value": (aten.scatter.value, (zeros, -1, index, 1.5), {}),
        "scatter-reduce-add": (aten.scatter.reduce, (zeros, -1, index, grads), {"reduce": "add"}),
        "scatter_reduce-sum": (aten.scatter_reduce.two, (zeros, -1, index, grads, "sum"), {}),
        "scatter_reduce-mean": (aten.scatter_reduce.two, (zeros, -1, index, grads, "mean"), {}),
        "scatter_reduce-amax-exclude-self": (
            aten.scatter_reduce.two, (zeros, -1, index, grads, "amax"), {"include_self": False},
        ),
        "scatter_reduce_-rows": (aten.scatter_reduce_.two, (table.clone(), 0, wide_rows, sources, "sum"), {}),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_calls(torch.float32)))
def test_a_gather_or_scatter_holds_what_its_kernel_allocates(name: str, dtype: torch.dtype):
    """The rule's bytes beside the op's output equal what the CPU allocator held beyond the outputs while the op ran
    (a bfloat16 gather of [8, 32, 32]: 32,768 B; its scatter_add_ into [8, 32, 64]: 65,536 B; float32: none)."""
    if name.endswith("rows") and not _radix_sort_with_openmp():
        pytest.skip("this torch has no FBGEMM radix sort: no GNN fast path")
    op, args, kwargs = _calls(dtype)[name]
    with torch.backends.mkldnn.flags(enabled=False):
        measured = held_beside_outputs(lambda: op(*args, **kwargs))
    assert kernel_scratch_bytes(op, args, kwargs, "cpu") == measured
    assert kernel_scratch_bytes(op, args, kwargs, "cuda") == 0  # CUDA's kernels accumulate in registers


class _Disentangled(torch.nn.Module):
    """DeBERTa-v2's content-to-position scores in small: `torch.gather(q @ pos_k^T, -1, c2p_pos)` added to the content
    scores; the step's peak is the gather's gradient (gather_backward's scatter_add_ into zeros of the scores' size)."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.positions = torch.nn.Parameter(torch.randn(128, 16))
        self.register_buffer("c2p", torch.randint(0, 128, (32, 32)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.query(x), self.key(x)
        c2p = torch.bmm(q, self.positions.T.expand(x.shape[0], 16, 128))
        scores = torch.bmm(q, k.transpose(-1, -2)) + torch.gather(c2p, -1, self.c2p.expand(x.shape[0], 32, 32))
        return scores.float().square().mean()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_bf16_step_holds_the_gather_s_float32_buffers(precision: str):
    """A bfloat16 step whose peak is a gather's backward: memplan's trace, and its CPU counter, as the plain run (in
    bfloat16 both had been 24,576 B low, 140,360 B for 164,936: the peak is the scatter_add_'s float32 copy of its
    [4, 32, 128] zeros, 65,536 B)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def build() -> Callable[[], None]:
        torch.manual_seed(0)
        model = _Disentangled().to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        return training_iteration(model, torch.randn(4, 32, 16, dtype=dtype), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("disentangled", _Disentangled, (32, 16))
    # the batch in the weights' dtype, as a bf16 run's loop casts it
    spec = dataclasses.replace(spec, make_batch=lambda settings, d: torch.randn(settings.batch_size, 32, 16, dtype=d))
    settings = TrainingSettings(batch_size=4, device="cpu", optimizer="sgd", precision=precision)
    with torch.backends.mkldnn.flags(enabled=False):
        assert simulate(trace_step(spec, settings)).peak_bytes == measured
        assert measure_cpu(spec, settings).peak_bytes == measured
