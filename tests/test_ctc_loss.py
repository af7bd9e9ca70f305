"""`F.ctc_loss` under memplan's fake tensors: `_ctc_loss` is tagged `dynamic_output_shape`, so the fake mode had refused
it as data-dependent even with Python int lengths; memplan.estimator.oprules.ctc lays its two outputs out as the real
kernel does (log_alpha [N, T, 2 * max(target_lengths) + 1]), and the CPU backward's log_beta, a second log_alpha, is
its scratch (memplan.estimator.composite_kernels.ctc_loss).

Truth: the plain step run for real on the CPU, measured by the CPU allocator's own events (tests/hand_measure.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from memplan.errors import TraceError
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

FRAMES, LABELS, TARGET, FEATURES, BATCH = 40, 6, 12, 8, 4


class _Transcriber(torch.nn.Module):
    """A linear layer's log-probabilities over [B, 40] frames, a summed CTC loss against fixed targets (2-D, or
    concatenated 1-D), the lengths Python lists (or tensors)."""

    def __init__(
        self, concatenated: bool = False, tensor_lengths: bool = False, loss: torch.nn.Module | None = None
    ) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(FEATURES, LABELS)
        self.concatenated, self.tensor_lengths, self.loss = concatenated, tensor_lengths, loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        log_probs = self.linear(x).log_softmax(-1).transpose(0, 1)  # [T, N, C]
        target_lengths = [TARGET - (sample % 3) for sample in range(batch)]
        targets = torch.arange(batch * TARGET).reshape(batch, TARGET) % (LABELS - 1) + 1
        if self.concatenated:
            targets = torch.cat([row[:length] for row, length in zip(targets, target_lengths, strict=True)])
        input_lengths = [FRAMES] * batch
        if self.tensor_lengths:
            input_lengths, target_lengths = torch.tensor(input_lengths), torch.tensor(target_lengths)
        if self.loss is not None:
            return self.loss(log_probs, targets, input_lengths, target_lengths)
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="sum")


def _spec(**options):
    spec = loss_returning_spec("ctc", lambda: _Transcriber(**options), (FRAMES, FEATURES))
    return dataclasses.replace(
        spec,
        make_batch=lambda settings, dtype: torch.randn(
            settings.batch_size, FRAMES, FEATURES, generator=torch.Generator().manual_seed(1)
        ),
    )


@pytest.mark.parametrize("concatenated", [False, True], ids=["padded-targets", "concatenated-targets"])
def test_a_ctc_step_with_int_lengths_matches_a_plain_run(concatenated, no_fallback_kernel):
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    spec = _spec(concatenated=concatenated)

    def build():
        torch.manual_seed(0)
        model = _Transcriber(concatenated)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, spec.make_batch(settings, None), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured


def test_ctc_lengths_computed_as_tensors_are_refused_saying_why():
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    with pytest.raises(TraceError, match=r"2 \* max\(target_lengths\) \+ 1.*Python lists"):
        trace_step(_spec(tensor_lengths=True), settings)


@pytest.mark.parametrize("zero_infinity", [False, True], ids=["plain", "zero-infinity"])
def test_a_mean_ctc_loss_traces_and_matches_a_plain_run(zero_infinity, no_fallback_kernel):
    """nn.CTCLoss's default reduction, 'mean', divides by `at::tensor(target_lengths, ...)`, an `empty` whose data
    ATen's C++ writes directly, which a fake tensor has none of: tracing had failed ("data is not allocated yet");
    memplan.estimator.composite_losses runs that mean op for op in Python while a step is traced."""
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")

    def model():
        return _Transcriber(loss=torch.nn.CTCLoss(reduction="mean", zero_infinity=zero_infinity))

    spec = dataclasses.replace(_spec(), build=lambda settings: model())

    def build():
        torch.manual_seed(0)
        optimizer = torch.optim.SGD((module := model()).parameters(), lr=0.1)
        build.kept = module
        return training_iteration(module, spec.make_batch(settings, None), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured
