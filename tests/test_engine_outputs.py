"""What an autograd Node returned lives until the engine has accumulated all of it (torch/csrc/autograd/engine.cpp,
evaluate_function: `outputs` is held until it returns). InputBuffer::add moves a gradient into an empty slot, but
accumulates one into a filled slot by reference (`old_var.add_(var)` or `old_var + var`, input_buffer.cpp,
accumulate), so that gradient stays in `outputs` while the Node's later outputs are accumulated, out of place where
the slot's gradient is shared. A gradient penalty's backward (create_graph=True, then backward through the
gradient) meets this: l2's AddmmBackward0 accumulates its input's gradient, then adds its weight's gradient to the
one the double backward left, a new [256, 256] buffer, with the input's gradient still held. memplan freed that
gradient at its accumulation: 65,536 B (one [64, 256] float32 tensor, 4.3%) low. Truth: the same step run for real,
by the CPU allocator's own events (no dispatch mode on the run)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak

BATCH = 64


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def mlp() -> nn.Module:
    return Mlp()


def features(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 64)


def gradient_penalty(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """The squared gradient of the output with respect to the input, minimized."""
    x = batch.clone().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    grad.pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def loss_and_gradient_penalty(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """WGAN-GP's shape: a loss and the penalty on the input gradient's norm, one backward."""
    x = batch.clone().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.square().mean() + 10 * (grad.norm(dim=1) - 1).pow(2).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _profiled(step) -> int:  # type: ignore[no-untyped-def]
    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model, batch = mlp(), features(BATCH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        return lambda: step(model, batch, optimizer)

    return profiled_third_iteration_peak(build)


@pytest.mark.parametrize("step", [gradient_penalty, loss_and_gradient_penalty], ids=lambda step: step.__name__)
def test_a_nodes_accumulated_gradient_lives_until_its_other_outputs_are_accumulated(step):
    spec = resolve_model("tests.test_engine_outputs:mlp", inputs="tests.test_engine_outputs:features")
    settings = spec.settings_for(
        TrainingSettings(
            batch_size=BATCH, device="cpu", optimizer="sgd", step=f"tests.test_engine_outputs:{step.__name__}"
        )
    )
    predicted = simulate(trace_step(spec, settings))
    assert predicted.phase == "backward"
    assert abs(predicted.peak_bytes - _profiled(step)) <= 8
