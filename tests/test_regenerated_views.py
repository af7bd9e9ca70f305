"""memplan.estimator.regenerated_views: the buffer a view changed in place costs in the backward of a real tensor.

Truth: the same step run for real on the CPU (memplan.measure.cpu counts every storage until a weakref finalizer
reports it freed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

CHANNELS = 16


class NormActBlock(nn.Module):
    """conv -> InstanceNorm2d (its output is a view of batch norm's) -> SiLU in place, as CycleGAN-style
    generators have it; or LayerNorm over channels through permutes, the activation in place on the permute."""

    def __init__(self, permuted: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.permuted = permuted
        self.norm = nn.LayerNorm(CHANNELS) if permuted else nn.InstanceNorm2d(CHANNELS, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if self.permuted:
            y = self.norm(y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        else:
            y = self.norm(y)
        return x + nn.functional.silu(y, inplace=True)


class Stack(nn.Module):
    def __init__(self, permuted: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NormActBlock(permuted) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def instance_norm_stack() -> nn.Module:
    return Stack(permuted=False)


def permuted_norm_stack() -> nn.Module:
    return Stack(permuted=True)


def images(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, CHANNELS, 32, 32)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.square().mean()


@pytest.mark.parametrize("model", ["instance_norm_stack", "permuted_norm_stack"])
@pytest.mark.parametrize("checkpoint", ["none", "all"])
def test_a_view_changed_in_place_costs_its_base_in_the_backward(model, checkpoint):
    """Each block's backward allocates its base's storage again (AsStridedBackward0's new_zeros), held until the
    base's CopySlices Node is done: 256 KiB per block at batch 4 (262,148 B of the checkpointed step was missing)."""
    spec = resolve_model(
        f"tests.test_regenerated_views:{model}",
        inputs="tests.test_regenerated_views:images",
        loss="tests.test_regenerated_views:mean_square",
    )
    settings = spec.settings_for(TrainingSettings(batch_size=4, device="cpu", checkpoint=checkpoint, optimizer="sgd"))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert abs(predicted - measure_cpu(spec, settings).peak_bytes) <= 8


class LinearThenInPlaceReLU(nn.Module):
    """nn.Linear on a 3-D input returns a view of its 2-D product; ReLU(inplace=True) changes that view."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(nn.functional.relu(self.first(x), inplace=True))


def tokens(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 1024, 64)


def test_the_incoming_gradient_goes_when_the_regenerated_view_s_node_returns():
    """AsStridedBackward0 copies its incoming gradient into the buffer and returns the buffer, so the gradient goes
    as it returns; the view replayed under fake tensors handed CopySlices a view of the incoming gradient, which it
    held through its whole formula: one activation's gradient high (16,636 B at batch 2, a helper's bug hunt)."""
    spec = resolve_model(
        "tests.test_regenerated_views:LinearThenInPlaceReLU",
        inputs="tests.test_regenerated_views:tokens",
        loss="tests.test_regenerated_views:mean_square",
    )
    settings = spec.settings_for(TrainingSettings(batch_size=2, device="cpu", optimizer="sgd"))
    assert simulate(trace_step(spec, settings)).peak_bytes == measure_cpu(spec, settings).peak_bytes
