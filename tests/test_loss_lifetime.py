"""How long the canonical loop's `loss` lives: bound by `loss = loss_of(model(batch))`, it holds the loss's autograd
graph through the optimizer step, until the iteration ends (memplan.estimator.loop, TrainingState.kept_loss). The
backward frees the graph's saved tensors, not its Nodes, nor what a custom Function keeps on its context: torch's
reentrant checkpoint keeps its copy of the CPU generator's state (5,056 B a region) until the graph goes.

Truth: the canonical loop written out in plain PyTorch (tests/hand_measure.py's training_iteration, whose `loss`
lives until the iteration returns), measured by the CPU allocator's own events; memplan's loop is on neither side."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

WIDTH, POSITIONS, BLOCKS, BATCH = 64, 8, 4, 1


class Stack(nn.Module):
    """A stem and four MLP blocks, each under torch's reentrant checkpoint where `reentrant`; returns its loss."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(BLOCKS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True) if self.reentrant else block(x)
        return x.square().mean()


@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant-checkpoint"])
def test_the_loss_and_its_graph_live_through_the_optimizer_step(reentrant):
    """Adam at batch 1: the step's peak. The loss (4 B) and, under reentrant checkpoints, each region's RNG state
    (4 x 5,056 B) are alive at it; memplan had let the loss go as its backward returned: 4 B, and 20,228 B, low."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = Stack(reentrant)
        optimizer = torch.optim.Adam(model.parameters())
        batch = torch.randn(BATCH, POSITIONS, WIDTH)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec(f"stack-reentrant-{reentrant}", lambda: Stack(reentrant), (POSITIONS, WIDTH))
    simulation = simulate(trace_step(spec, TrainingSettings(batch_size=BATCH, device="cpu", optimizer="adam")))
    assert simulation.phase == "optimizer"
    assert simulation.peak_bytes == measured
