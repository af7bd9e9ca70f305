"""Manual backward formulas whose temporaries die at their statement's end (memplan.estimator.manual_formulas) and
formulas whose plain path combines a mask in place (memplan.estimator.plain_formulas), in an MLP whose hidden
activation goes through the op before its output is summed into the loss.

Truth: the same step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's own
allocation and free events (tests/hand_measure.py). Before these rules, each was over-predicted: torch.renorm by
328,832 B, torch.sinc by 147,460 B, torch.norm(p=0.5) by 131,328 B, torch.norm(p=3) / linalg.vector_norm(ord=3) and
var_mean / std_mean (both outputs used) by about 64 KiB (one activation), atan2 and clamp with tensor bounds by one
boolean mask (16,384 B).
"""

from __future__ import annotations

import pytest
import torch

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

BATCH, FEATURES, HIDDEN = 64, 32, 256


def _through(name: str, h: torch.Tensor) -> torch.Tensor:
    """The [BATCH, HIDDEN] activation `h` through the op `name`."""
    bound = torch.full((HIDDEN,), 0.5)
    ops = {
        "renorm": lambda: torch.renorm(h, 2, 0, 1.0),
        "sinc": lambda: torch.sinc(h),
        "norm-p3": lambda: torch.norm(h, p=3, dim=1),
        "vector_norm-ord3": lambda: torch.linalg.vector_norm(h, ord=3, dim=1),
        "norm-p1.5": lambda: torch.norm(h, p=1.5, dim=1),
        "norm-p0.5": lambda: torch.norm(h, p=0.5, dim=1),
        "norm-p3-whole": lambda: torch.norm(h, p=3),
        "var_mean": lambda: sum(torch.var_mean(h, dim=1)),
        "std_mean": lambda: sum(torch.std_mean(h, dim=1)),
        "atan2": lambda: torch.atan2(h, h * 2),
        "atan2-self": lambda: torch.atan2(h, bound),
        "atan2-other": lambda: torch.atan2(bound, h),
        "clamp-tensors": lambda: torch.clamp(h, min=-bound, max=bound),
        "clamp-tensors-grads": lambda: torch.clamp(h, min=h[:, :1] - 1, max=h[:, 1:2] + 1),
    }
    return ops[name]()


class _Through(torch.nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.linear, self.op = torch.nn.Linear(FEATURES, HIDDEN), op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _through(self.op, self.linear(x)).sum()


@pytest.mark.parametrize(
    "op",
    [
        "renorm",
        "sinc",
        "norm-p3",
        "vector_norm-ord3",
        "norm-p1.5",
        "norm-p0.5",
        "norm-p3-whole",
        "var_mean",
        "std_mean",
        "atan2",
        "atan2-self",
        "atan2-other",
        "clamp-tensors",
        "clamp-tensors-grads",
    ],
)
def test_a_formula_s_temporaries_die_as_a_plain_run_s_do(op):
    def build():
        torch.manual_seed(0)
        model = _Through(op)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(BATCH, FEATURES), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec(f"{op}-mlp", lambda: _Through(op), (FEATURES,))
    predicted = simulate(trace_step(spec, TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")))
    assert predicted.peak_bytes == measured
