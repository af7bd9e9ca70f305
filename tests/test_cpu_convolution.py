"""memplan.estimator.composite_kernels' Slow2d rules: a CPU convolution that oneDNN does not run (oneDNN off, as
tests/hand_measure.py measures, or float64) allocates its im2col columns inside `thnn_conv2d` and again inside
`_slow_conv2d_backward`, and a grouped one each group's input (and grad_output) slices, which no dispatch mode sees.

Truth: the same step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's own events
(tests/hand_measure.py). Before the rules a [2, 8, 16, 16] 3x3 convolution's step was 21,056 B (10.2%) low."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

BATCH = 2
CASES = {
    "3x3": (lambda: nn.Conv2d(8, 16, 3, padding=1), (8, 16, 16), False),
    "3x3-stride-2": (lambda: nn.Conv2d(8, 16, 3, stride=2, padding=1), (8, 16, 16), False),
    "depthwise": (lambda: nn.Conv2d(8, 8, 7, padding=3, groups=8), (8, 16, 16), False),
    "grouped-channels-last": (lambda: nn.Conv2d(8, 16, 5, padding=2, groups=2), (8, 16, 16), True),
    "conv1d": (lambda: nn.Conv1d(8, 16, 9, padding=4), (8, 64), False),
}


class _Convolved(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        make, _, self.channels_last = CASES[case]
        self.conv = make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.conv(x).square().mean()


@pytest.mark.parametrize("case", list(CASES))
def test_a_slow_cpu_convolution_holds_its_columns(case):
    shape = CASES[case][1]

    def build():
        torch.manual_seed(0)
        model = _Convolved(case)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        return training_iteration(model, torch.randn(BATCH, *shape), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)  # oneDNN off: the Slow2d backend
    spec = loss_returning_spec(f"conv-{case}", lambda: _Convolved(case), shape)
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    with torch.backends.mkldnn.flags(enabled=False):
        assert simulate(trace_step(spec, settings)).peak_bytes == measured
        assert measure_cpu(spec, settings).peak_bytes == measured
