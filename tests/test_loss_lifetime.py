"""How long the canonical loop's `loss` lives: bound by `loss = loss_of(model(batch))`, it holds the loss's autograd
graph through the optimizer step, until the iteration ends (memplan.estimator.loop, TrainingState.kept_loss). The
backward frees the graph's saved tensors, not its Nodes, nor what a custom Function keeps on its context: torch's
reentrant checkpoint keeps its copy of the CPU generator's state (5,056 B a region) until the graph goes.

Truth: the canonical loop written out in plain PyTorch (tests/hand_measure.py's training_iteration, whose `loss`
lives until the iteration returns), measured by the CPU allocator's own events; memplan's loop is on neither side."""

from __future__ import annotations

import dataclasses

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


class KeptOnContext(torch.autograd.Function):
    """Squares its input, keeping the input as a context attribute, not with save_for_backward (as bitsandbytes'
    8-bit matmuls keep theirs): the backward does not free it, the graph holds it until it goes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.x = x
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 2 * ctx.x * grad


class ContextStack(nn.Module):
    """Four blocks whose wide activation a KeptOnContext keeps on its context; returns its output (a copy eight
    times as wide) or its loss."""

    def __init__(self, returns_loss: bool) -> None:
        super().__init__()
        self.returns_loss = returns_loss
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.ups = nn.ModuleList(nn.Linear(WIDTH, 4 * WIDTH) for _ in range(BLOCKS))
        self.downs = nn.ModuleList(nn.Linear(4 * WIDTH, WIDTH) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for up, down in zip(self.ups, self.downs, strict=True):
            x = down(KeptOnContext.apply(up(x)))
        return x.square().sum() if self.returns_loss else x.unsqueeze(-1).expand(*x.shape, 8).contiguous()


def square_sum(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return output.square().sum()


@pytest.mark.parametrize(
    ("loop", "grad_accum"),
    [("canonical", 2), ("canonical", 3), ("keep-output", 2)],
    ids=["accum2", "accum3", "keep-out"],
)
def test_the_previous_micro_batch_graph_lives_through_the_next_forward(loop, grad_accum):
    """SGD at batch 4, 64 positions, accumulating: the last micro-batch's forward peak. The previous micro-batch's
    `loss` (or `out`) is bound until the forward returns and binds it again, and with it its graph, whose contexts keep
    each block's 65,536 B input (and `out` its 524,288 B): memplan traced the last micro-batch alone, 655,356 B
    (canonical) and 65,524 B (keep-output) low; one graph at a time whatever the count of micro-batches."""
    keep_output = loop == "keep-output"
    positions, batch_size = 64, 4

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = ContextStack(returns_loss=not keep_output)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(batch_size, positions, WIDTH)
        build.kept = (model, optimizer, batch)
        if not keep_output:
            return training_iteration(model, batch, lambda loss, _: loss, optimizer, grad_accum=grad_accum)

        def iteration() -> None:  # `out = model(...)`, `del out` after the step
            for _ in range(grad_accum):
                out = model(batch)
                (square_sum(out, batch) / grad_accum).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del out

        return iteration

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec(f"context-stack-{loop}", lambda: ContextStack(not keep_output), (positions, WIDTH))
    if keep_output:
        spec = dataclasses.replace(spec, loss_of=square_sum)
    settings = TrainingSettings(batch_size=batch_size, device="cpu", optimizer="sgd", grad_accum=grad_accum, loop=loop)
    simulation = simulate(trace_step(spec, settings))
    assert simulation.phase == "forward"
    assert simulation.peak_bytes == measured
