"""memplan.estimator.liveness: when each storage a traced step makes is born and freed, one entry a storage.

Truth for the peak: the same step run for real on the CPU (memplan.measure.cpu counts every storage until a weakref
finalizer reports it freed)."""

from __future__ import annotations

import torch
from torch import nn

from memplan.estimator.liveness import liveness
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings


class PerSample(nn.Module):
    """Each sample's features projected on its own, as a vision-language model splits its image features one image a
    tensor: `unbind` returns one view a sample, all of one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.proj(sample) for sample in x.unbind(0)])


def per_sample() -> nn.Module:
    return PerSample()


def features(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 8, 16)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.square().mean()


def test_an_op_returning_a_view_a_sample_is_one_storage_and_the_peak_is_the_real_runs():
    """`unbind` over a batch of 64 gave 64 entries, all one storage, and every reader's loop walked them all: a largest-
    batch search of a tiny LLaVA on an H100 (batches near 10,000) spent 2 of its 2.7 minutes there."""
    spec = resolve_model(
        "tests.test_liveness:per_sample", inputs="tests.test_liveness:features", loss="tests.test_liveness:mean_square"
    )
    settings = spec.settings_for(TrainingSettings(batch_size=64, device="cpu", optimizer="sgd"))
    traced = trace_step(spec, settings)
    lifetimes = liveness(traced)
    (unbind,) = [index for index, node in enumerate(lifetimes.nodes) if node.target == torch.ops.aten.unbind.int]
    assert len(lifetimes.storages[unbind]) == 1
    for outputs in lifetimes.storages:
        assert len({key for key, _ in outputs}) == len(outputs)
    assert simulate(traced).peak_bytes == measure_cpu(spec, settings).peak_bytes
