"""memplan.estimator.composite_kernels.matrix_exp: the temporaries linalg_matrix_exp's kernel (mexp) holds inside
itself, at the top of the range its matrices' norms pick from, and its gradient's statements
(memplan.estimator.manual_formulas, LinalgMatrixExpBackward0).

Truth: the CPU allocator's own events (torch.profiler), in a plain run with no dispatch mode active
(tests/hand_measure.py): for the kernel alone, and for a whole step through torch.nn.utils.parametrizations.orthogonal
(its default map for a square weight). Before the rule, the orthogonal Linear(64, 64) step was predicted 281,096 B
against 789,012 B measured (validate's counter, a mode, 215,560 B); with the rule but the gradient's inner cats held
to its formula's end, 81,920 B above the top.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.notes import value_dependent_kernel_notes
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import held_beside_outputs, profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

MATRIX_EXP = torch.ops.aten.linalg_matrix_exp.default


def _matrices(n: int, norms: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A batch of n x n matrices whose 1-norms (what picks mexp's Taylor degree) are `norms`."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(len(norms), n, n, generator=generator, dtype=dtype)
    scale = torch.tensor(norms, dtype=a.real.dtype).view(-1, 1, 1)
    return a / torch.linalg.matrix_norm(a, ord=1, keepdim=True) * scale


@pytest.mark.parametrize("n", [2, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_one_matrix_s_exponential_holds_the_top_of_its_range(n, dtype):
    """A norm past theta_12 takes the degree-18 path, the fullest (196,632 B for a float32 64x64); smaller norms hold
    less, down to half of it at 0.01."""
    top = _matrices(n, [10.0], dtype)[0]
    predicted = kernel_scratch_bytes(MATRIX_EXP, (top,), {}, "cpu")
    assert predicted == held_beside_outputs(lambda: torch.linalg.matrix_exp(top))
    for norm in (0.0, 0.01, 0.3, 1.0, 2.0):
        a = _matrices(n, [norm], dtype)[0]
        assert held_beside_outputs(lambda a=a: torch.linalg.matrix_exp(a)) <= predicted


@pytest.mark.parametrize("n", [2, 16, 64])
def test_a_batch_s_exponential_holds_every_matrix_squared_apart_at_most(n):
    """A batch takes the degree-18 path whatever the norms; matrices scaled apart keep each group's accumulator."""
    apart = _matrices(n, [2.0**k for k in range(2, 10)])  # eight scales: eight groups
    predicted = kernel_scratch_bytes(MATRIX_EXP, (apart,), {}, "cpu")
    assert predicted == held_beside_outputs(lambda: torch.linalg.matrix_exp(apart))
    alike = _matrices(n, [10.0] * 8)
    assert held_beside_outputs(lambda: torch.linalg.matrix_exp(alike)) <= predicted
    pair = _matrices(n, [10.0, 10.0])  # few matrices: their polynomial's buffers are the fullest, to the byte
    if n > 2:
        assert kernel_scratch_bytes(MATRIX_EXP, (pair,), {}, "cpu") == held_beside_outputs(
            lambda: torch.linalg.matrix_exp(pair)
        )


def test_a_large_batch_s_accumulators_are_as_many_as_float32_has_scales():
    """Finite float32 norms take at most 128 scales (s = 0 ... 127 above theta_18 = 3.01), so a batch splits into at
    most 128 groups, each keeping its accumulator: the top is 127 single-matrix groups first and the rest last. Counted
    as every matrix its own group (1,000 accumulators), 1,000 float32 4x4 matrices were predicted 32,564,000 B
    against this 8,168,928 B."""
    theta_18 = 3.010066362817634
    norms = [1.0] + [0.75 * theta_18 * 2.0**k for k in range(1, 127)] + [3.3e38] * (1000 - 127)
    worst = _matrices(4, norms)
    predicted = kernel_scratch_bytes(MATRIX_EXP, (worst,), {}, "cpu")
    measured = held_beside_outputs(lambda: torch.linalg.matrix_exp(worst))
    assert measured <= predicted <= measured * 1.01


class _Orthogonal(nn.Module):
    """An orthogonal Linear (matrix_exp of a skew matrix), its raw parameter `scale` times a Gaussian (None: as the
    parametrization leaves it, -I, whose exponential's norms stay small)."""

    def __init__(self, n: int, scale: float | None) -> None:
        super().__init__()
        self.linear = orthogonal(nn.Linear(n, n))
        if scale is not None:
            with torch.no_grad():
                original = self.linear.parametrizations.weight.original
                original.copy_(torch.randn(n, n, generator=torch.Generator().manual_seed(1)) * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).square().mean()


def _plain_run_peak(n: int, scale: float | None, batch: int) -> int:
    def build():
        torch.manual_seed(0)
        model = _Orthogonal(n, scale)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(batch, n), lambda out, _: out, optimizer)

    return profiled_third_iteration_peak(build)


@pytest.mark.parametrize(("n", "batch"), [(64, 8), (32, 4)])
def test_an_orthogonal_layer_s_step_counts_its_exponentials_top(n, batch):
    spec = loss_returning_spec("orthogonal", lambda: _Orthogonal(n, 1.0), (n,))
    settings = TrainingSettings(batch_size=batch, device="cpu", optimizer="sgd")
    traced = trace_step(spec, settings)
    measured = _plain_run_peak(n, 1.0, batch)  # large norms: both exponentials at their top
    assert simulate(traced).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured
    # as the parametrization leaves it: small norms, a lower peak, never above the prediction
    assert _plain_run_peak(n, None, batch) <= simulate(traced).peak_bytes
    assert value_dependent_kernel_notes(traced.graph)
