"""memplan.estimator.composite_kernels: what a kernel holds of the ops it calls inside itself, which no dispatch mode
sees (neither memplan's trace nor its CPU counter): a reduction's cast of its input, a CPU mean's float32 sum of a
16-bit input.

Truth: the same step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's own events
(tests/hand_measure.py, torch.profiler), and memplan's own counter (which profiles such calls) beside it. Before the
rules, each case here was low by the cast (a bool mask's sum copies it whole to int64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

BATCH, POSITIONS, FEATURES, WIDTH = 4, 8, 16, 512


def _reduce(name: str, y: torch.Tensor) -> torch.Tensor:
    """y's mean square, plus nothing times a reduction of a tensor 16 times y's size (so the step's peak is there)."""
    wide = y.detach().unsqueeze(-1).expand(*y.shape, 16)
    if name == "mask-count":  # counting positions, as a masked loss normalizes by them
        reduced = (wide > 0).sum()
    elif name == "int32-sum-dim":
        reduced = (wide > 0).int().sum(-1).sum()
    elif name == "mean":  # a 16-bit mean sums a float32 copy on the CPU
        reduced = (wide * 1).mean()
    elif name == "mean-dim":
        reduced = (wide * 1).mean(-1).sum()
    elif name == "bce":  # its kernel's own mean of the unreduced loss (a reviewer's repro: a bf16 one 32.8% low)
        reduced = torch.nn.functional.binary_cross_entropy_with_logits(wide * 1, torch.ones_like(wide))
    elif name == "kthvalue":  # selects in a copy of its input and an int64 index per element (a helper's hunt: -44%)
        reduced = (wide * 1).kthvalue(3, -1).values.sum()
    elif name in ("median", "nanmedian"):  # a whole tensor's: nth_element in a copy
        reduced = getattr(wide * 1, name)()
    elif name == "soft-margin":  # its backward's exp(-target * input) with both factors held (y's own gradient)
        return torch.nn.functional.soft_margin_loss(y, torch.ones_like(y))
    else:
        raise ValueError(name)
    return y.pow(2).mean() + 0 * reduced


class _Reducing(torch.nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        self.linear, self.loss = torch.nn.Linear(FEATURES, WIDTH), loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _reduce(self.loss, self.linear(x))


def _plain_run_peak(loss: str, dtype: torch.dtype) -> int:
    def build():
        torch.manual_seed(0)
        model = _Reducing(loss).to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(BATCH, POSITIONS, FEATURES, dtype=dtype)
        return training_iteration(model, batch, lambda out, _: out, optimizer)

    return profiled_third_iteration_peak(build)


# The CPU's reductions split over threads keep each thread's partial result (8 B here on two threads: `pytest`
# alone and CI's torch 2.11 leg; none under `pytest -n`, whose workers run one thread, tests/conftest.py), which no
# rule models.
THREAD_PARTIALS = 16


@pytest.mark.parametrize(
    ("loss", "precision"),
    [
        ("mask-count", "fp32"),
        ("int32-sum-dim", "fp32"),
        ("mean", "bf16"),
        ("mean-dim", "bf16"),
        ("bce", "bf16"),
        ("kthvalue", "fp32"),
        ("median", "fp32"),
        ("nanmedian", "bf16"),
        ("soft-margin", "fp32"),
    ],
)
def test_a_reduction_holds_its_input_s_cast_while_it_runs(loss, precision):
    spec = loss_returning_spec(f"{loss}-loss", lambda: _Reducing(loss), (POSITIONS, FEATURES))
    # the batch in the weights' dtype, as a bf16 run's loop casts it
    spec = dataclasses.replace(
        spec, make_batch=lambda settings, dtype: torch.randn(settings.batch_size, POSITIONS, FEATURES, dtype=dtype)
    )
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd", precision=precision)
    measured = _plain_run_peak(loss, torch.bfloat16 if precision == "bf16" else torch.float32)
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert measured - THREAD_PARTIALS <= predicted <= measured
    assert measured - THREAD_PARTIALS <= measure_cpu(spec, settings).peak_bytes <= measured


class _ScaledBatchNorm(torch.nn.Module):
    """A batch norm whose input needs a gradient (a per-channel scale before it), the step's peak in its backward:
    no convolution (whose CPU kernel's own scratch memplan leaves out: README)."""

    def __init__(self, channels_last: bool) -> None:
        super().__init__()
        self.channels_last = channels_last
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.norm = torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        h = self.norm(x * self.scale.view(1, -1, 1, 1))
        return self.head(h.mean((2, 3))).square().sum()


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_batch_norm_s_cpu_backward_holds_a_second_input_sized_buffer(channels_last):
    """batch_norm_backward_cpu_template allocates grad_input twice where input and grad_out share a contiguous
    format, the first freed only as the second replaces it: memplan had been one input-sized buffer low there
    (a [4, 16, 14, 14] float32 input's 50,176 B: 17% of the step's peak)."""
    shape = (16, 14, 14)

    def build():
        torch.manual_seed(0)
        model = _ScaledBatchNorm(channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        return training_iteration(model, torch.randn(BATCH, *shape), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("batch-norm", lambda: _ScaledBatchNorm(channels_last), shape)
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured
