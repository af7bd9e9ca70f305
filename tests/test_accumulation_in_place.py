"""memplan.estimator.engine_accumulation: the autograd engine's sum of a tensor's gradients runs in place where a
plain run's does, in memplan's trace and in its CPU counter.

Truth: the same step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's own
allocation and free events (tests/hand_measure.py, torch.profiler). Under any dispatch mode the engine adds out of
place (tests/test_engine_accumulation.py), so memplan's own CPU counter (a mode) is checked against the allocator's
events too. Each model below has its peak where the engine sums a tensor's gradients. Before engine_accumulation,
the trace and the counter were one gradient-sized buffer high on the first three (`residual` +130,812 B,
`three-uses` +131,060 B, `reused-slices` +126,976 B, of 436,496 to 571,404 B measured). The last two add out of
place in the plain run too, and must stay so: forced in place, the trace would be 130,820 B and 131,072 B low.
"""

from __future__ import annotations

import pytest
import torch

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

BATCH, POSITIONS, FEATURES, WIDTH, NARROW = 4, 16, 16, 512, 16


class _Reused(torch.nn.Module):
    """A [batch × positions, WIDTH] tensor `h` read by several ops. `_project`, the loss of most, is a product with a
    constant vector, whose backward saves no activation and makes a fresh gradient (MvBackward0: `grad.ger(vec)`),
    so that the backward's largest moment is where `h`'s gradients are summed."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape
        self.first = torch.nn.Linear(FEATURES, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 1)
        if shape == "same-gradient-twice":
            self.full = torch.nn.Parameter(torch.randn(BATCH * POSITIONS, WIDTH))
        self.register_buffer("vector", torch.randn(WIDTH))
        self.register_buffer("flat", torch.randn(BATCH * POSITIONS * WIDTH))

    def _project(self, y: torch.Tensor) -> torch.Tensor:
        return (y @ self.vector).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape == "same-gradient-twice":
            # AddBackward0 returns its incoming gradient as both inputs' gradients, one tensor, both to the
            # parameter's buffer: the engine adds it to itself, out of place (the buffer is not its last holder).
            return self._project(self.full + self.full)
        h = self.first(x.flatten(0, 1))
        if self.shape == "residual":  # h + f(h), f a scale: AddBackward0 hands its gradient on, MulBackward0 adds
            return self._project((h * 2).add_(h))
        if self.shape == "view-gradient":
            # The same residual, the loss a dot product of the flattened output: the gradient AddBackward0 hands on
            # is a view (ViewBackward0's reshape of DotBackward0's result), whose autograd metadata keeps its base:
            # two TensorImpls on one storage, so the engine adds out of place.
            return (h * 2).add_(h).flatten() @ self.flat
        if self.shape == "three-uses":
            narrow = h[:, :NARROW].square().mean()  # made first: the engine runs its backward last
            return narrow + self._project((h * 2).add_(h))
        if self.shape == "reused-slices":  # the gradients of two slices, each a whole-size buffer, summed
            return self.head(h).mean() + h[:, :NARROW].square().mean() + h[:, NARROW : 2 * NARROW].exp().mean()
        raise ValueError(self.shape)


SHAPES = ["residual", "three-uses", "reused-slices", "same-gradient-twice", "view-gradient"]
SETTINGS = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
# The allocator's events count, beyond the tensors memplan predicts, the bytes a CPU `mean` holds inside itself
# (its sum, then its division's cast) where a mean falls in the step's peak (tests/test_plain_formulas.py).
CPU_MEAN_INTERNALS = 12


def _plain_run_peak(shape: str) -> int:
    def build():
        torch.manual_seed(0)
        model = _Reused(shape)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        return training_iteration(model, torch.randn(BATCH, POSITIONS, FEATURES), lambda out, _: out, optimizer)

    return profiled_third_iteration_peak(build)


def _spec(shape: str):
    return loss_returning_spec(f"{shape}-gradients", lambda: _Reused(shape), (POSITIONS, FEATURES))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_trace_sums_gradients_in_place_where_a_plain_run_does(shape):
    measured = _plain_run_peak(shape)
    predicted = simulate(trace_step(_spec(shape), SETTINGS)).peak_bytes
    assert measured - CPU_MEAN_INTERNALS <= predicted <= measured


@pytest.mark.parametrize("shape", SHAPES)
def test_memplan_s_cpu_counter_measures_the_plain_run_s_sums(shape):
    measured = _plain_run_peak(shape)
    assert measured - CPU_MEAN_INTERNALS <= measure_cpu(_spec(shape), SETTINGS).peak_bytes <= measured
