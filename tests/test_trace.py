"""memplan.estimator.trace: what the traced iteration starts with is what a real one finds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memplan
from memplan.errors import SettingsError
from tests.hand_measure import measured_step_peak


class WithUnusedHead(nn.Module):
    """A head the loss never reaches (an auxiliary head, a pooler the task does not use): trainable, never graded."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.unused_head = nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).square().mean()


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 64)


@pytest.mark.parametrize(
    ("optimizer", "make"),
    [
        ("adamw", lambda params: torch.optim.AdamW(params)),
        ("sgd-momentum", lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)),
    ],
)
def test_parameters_no_gradient_reaches_get_no_optimizer_state(optimizer, make):
    """torch's optimizers skip a parameter whose .grad is None: measured on the real step, the head has none."""
    predicted = memplan.estimate(WithUnusedHead(), inputs=rows, batch_size=32, device="cpu", optimizer=optimizer)
    model = WithUnusedHead()

    def step(model, batch, optimizer):
        model(batch["x"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    measured = measured_step_peak(step, model, {"x": rows(32)}, make(model.parameters()))
    assert predicted.peak_bytes == pytest.approx(measured, rel=0, abs=16)  # torch.optim may keep a scalar or two


def _accumulating(model, batch, optimizer):
    for _ in range(2):
        (model(batch["x"]) / 2).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _zero_grad_before_backward(model, batch, optimizer):
    loss = model(batch["x"])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize(
    ("settings", "step"),
    [({"grad_accum": 2}, _accumulating), ({"loop": "zero-grad-before-backward"}, _zero_grad_before_backward)],
)
def test_a_loop_that_keeps_gradients_keeps_none_for_parameters_no_gradient_reaches(settings, step):
    """Where gradients outlive a micro-batch the traced one started with a gradient for every trainable parameter,
    the head's too, and AdamW state for it (1,016,584 B too many here)."""
    predicted = memplan.estimate(WithUnusedHead(), inputs=rows, batch_size=32, device="cpu", **settings)
    model = WithUnusedHead()
    measured = measured_step_peak(step, model, {"x": rows(32)}, torch.optim.AdamW(model.parameters()))
    assert predicted.peak_bytes == pytest.approx(measured, rel=0, abs=16)


class SparseEmbeddingBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(1000, 16, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).square().mean()


def test_a_sparse_embedding_is_refused_in_one_line():
    """Its gradient is a sparse COO tensor with no storage of its own: torch's "Cannot access storage of
    SparseTensorImpl" had come out blamed on the loss or optimizer."""
    ids = lambda batch_size: torch.randint(0, 1000, (batch_size, 4))  # noqa: E731
    with pytest.raises(SettingsError, match=r"module table makes sparse gradients \(EmbeddingBag\(sparse=True\)\)"):
        memplan.estimate(SparseEmbeddingBag(), inputs=ids, batch_size=8, device="cpu", optimizer="sgd")
