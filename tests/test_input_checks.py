"""memplan.estimator.input_checks: a check that reads values and raises where it finds something passes, as in a run
that trains. Truth: the step run for real on the CPU (memplan.measure.cpu)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.module_specs import loss_returning_spec


class _GaussianHead(torch.nn.Module):
    """A regression head predicting a mean and a variance, trained with the Gaussian negative log-likelihood."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        mean, variance = out[..., :8], F.softplus(out[..., 8:])
        return F.gaussian_nll_loss(mean, torch.zeros_like(mean), variance)


def test_the_gaussian_nll_loss_s_negative_variance_check_passes_and_its_ops_count():
    """`if torch.any(var < 0): raise` could not be traced: the loss was refused as depending on tensor values
    (a helper's bug hunt). Its comparison and reduction still run, as in the real run."""
    spec = loss_returning_spec("gaussian-head", _GaussianHead, (600, 16))
    settings = TrainingSettings(batch_size=2, device="cpu")
    assert simulate(trace_step(spec, settings)).peak_bytes == measure_cpu(spec, settings).peak_bytes


def test_torch_any_elsewhere_still_answers_with_its_tensor():
    from memplan.estimator.input_checks import input_checks_passing

    with input_checks_passing():
        found = torch.any(torch.tensor([0.0, -1.0]) < 0)
    assert isinstance(found, torch.Tensor) and bool(found)
