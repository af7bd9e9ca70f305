"""memplan.estimator.composite_losses: losses that run as one C++ composite hold their variables, and autocast's
casts of their arguments, until they return.

Truth: the step run for real on the CPU (memplan.measure.cpu). A Linear layer makes the loss's inputs, 1,024
positions of 16 features per sample; the loss is unreduced, then averaged (a helper's bug hunt found each low:
hinge 21%, margin ranking 11%, kl_div under autocast 11.5%, triplet margin under autocast 19%; cross entropy of 16-bit
logits under autocast, whose float32 cast lives through its nll_loss: a segmentation head's step 8 B low)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.module_specs import loss_returning_spec


class _LossOfALinear(torch.nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        self.linear, self.loss = torch.nn.Linear(16, 16), loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        a, b = y[..., :8], y[..., 8:]
        if self.loss == "hinge_embedding":
            unreduced = F.hinge_embedding_loss(y, torch.ones_like(y), reduction="none")
        elif self.loss == "margin_ranking":
            unreduced = F.margin_ranking_loss(a, b, torch.ones_like(a), reduction="none")
        elif self.loss == "cross_entropy":  # a class per position, as a segmentation head's loss over its pixels
            # what the forward holds past its loss and no backward reads (a head's own maps): the peak is the loss's
            held = torch.ones(y.shape[0], 1024 * 64)
            labels = torch.zeros(y.shape[0] * y.shape[1], dtype=torch.long)
            return F.cross_entropy(y.flatten(0, 1), labels, reduction="none").mean() + held.mean()
        elif self.loss == "kl_div":
            unreduced = F.kl_div(a.log_softmax(-1), b.softmax(-1), reduction="none")
        else:
            unreduced = F.triplet_margin_loss(a, b, y[..., 4:12], reduction="none")
        return unreduced.mean()


@pytest.mark.parametrize(
    ("loss", "precision"),
    [
        ("hinge_embedding", "fp32"),
        ("hinge_embedding", "amp-bf16"),
        ("margin_ranking", "fp32"),
        ("kl_div", "amp-bf16"),
        ("cross_entropy", "amp-bf16"),
        ("triplet_margin", "amp-bf16"),
    ],
)
def test_a_composite_loss_s_variables_live_until_it_returns(loss, precision):
    spec = loss_returning_spec(f"{loss}-loss", lambda: _LossOfALinear(loss), (1024, 16))
    settings = TrainingSettings(batch_size=2, device="cpu", precision=precision)
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert predicted == measure_cpu(spec, settings).peak_bytes
