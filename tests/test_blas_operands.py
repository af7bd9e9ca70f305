"""A matrix product's kernel copies an operand BLAS cannot read as it is laid out (memplan.estimator.composite_kernels.
blas_operands): the gradient of `linear(x).sum()` is a stride-0 expansion, which LinearBackward's two products each
copied whole on the CPU: the step was predicted 32,772 B low (107,524 B predicted, 140,296 B measured: Linear(32, 256),
batch 64, SGD). Truth: the CPU allocator's events of the op, or of the step, run plainly (no dispatch mode)."""

import pytest
import torch
from torch import nn

from memplan.estimator.composite_kernels import kernel_scratch_bytes, kernel_scratch_requests
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import held_beside_outputs, profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

aten = torch.ops.aten
_W, _X = torch.randn(256, 32), torch.randn(64, 32)
_ONES = torch.ones(()).expand(64, 256)  # the gradient `.sum()` gives its input

CALLS = {
    "expanded @ weight": (aten.mm.default, (_ONES, _W)),
    "expanded.t() @ input": (aten.mm.default, (_ONES.t(), _X)),
    "input @ expanded.t()": (aten.mm.default, (_X.t(), _ONES)),
    "column-expanded @ weight": (aten.mm.default, (torch.randn(64, 1).expand(64, 256), _W)),
    "row-expanded @ weight": (aten.mm.default, (torch.randn(1, 256).expand(64, 256), _W)),
    "strided slice @ matrix": (aten.mm.default, (_X[:, ::2], torch.randn(16, 256))),
    "both expanded": (aten.mm.default, (_ONES, torch.ones(()).expand(256, 8))),
    "expanded @ column": (aten.mm.default, (_ONES, torch.randn(256, 1))),
    "addmm, expanded": (aten.addmm.default, (torch.randn(32), _ONES, _W)),
    "contiguous @ transposed": (aten.mm.default, (_X, _W.t())),
    "transposed @ contiguous": (aten.mm.default, (_X.t(), torch.randn(64, 8))),
    "bmm, expanded": (aten.bmm.default, (torch.ones(()).expand(4, 64, 256), _W.expand(4, 256, 32))),
    "bmm, transposed items": (aten.bmm.default, (torch.randn(4, 256, 64).transpose(1, 2), _W.expand(4, 256, 32))),
    "bmm, int64 expanded": (
        aten.bmm.default,
        (torch.ones((), dtype=torch.long).expand(4, 64, 256), torch.ones(4, 256, 32, dtype=torch.long)),
    ),
    "bmm, complex sliced": (
        aten.bmm.default,
        (torch.randn(4, 64, 512, dtype=torch.cfloat)[:, :, ::2], torch.randn(4, 256, 32, dtype=torch.cfloat)),
    ),
    "bmm, small": (aten.bmm.default, (torch.ones(()).expand(2, 4, 8), torch.randn(2, 8, 4))),
    "baddbmm, expanded": (
        aten.baddbmm.default,
        (torch.randn(4, 64, 32), torch.ones(()).expand(4, 64, 256), _W.expand(4, 256, 32)),
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_matrix_product_copies_what_blas_cannot_read(name):
    op, args = CALLS[name]
    assert kernel_scratch_bytes(op, args, {}, "cpu") == held_beside_outputs(lambda: op(*args))


def test_the_cuda_target_copies_what_cublas_cannot_read():
    """prepare_matrix_for_cublas: an expanded operand is copied whole; a transposed or sliced-by-rows one is not."""
    assert kernel_scratch_requests(aten.mm.default, (_ONES, _W), {}, "cuda") == (64 * 256 * 4,)
    assert kernel_scratch_requests(aten.mm.default, (_X, _W.t()), {}, "cuda") == ()
    assert kernel_scratch_requests(aten.mm.default, (torch.randn(64, 64)[:, :32], _W.t()), {}, "cuda") == ()


class _SummedLinear(nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.reduction = nn.Linear(32, 256), reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h.sum() if self.reduction == "sum" else h.mean()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_step_whose_loss_sums_a_linear_layer_s_output(reduction):
    def build():  # type: ignore[no-untyped-def]
        model = _SummedLinear(reduction)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(64, 32)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec(f"summed-linear-{reduction}", lambda: _SummedLinear(reduction), (32,))
    settings = TrainingSettings(batch_size=64, device="cpu", optimizer="sgd")
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured  # validate's counter reads the copies off the allocator
