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


def _op_scratch_measured(args: tuple) -> tuple[int, set[str]]:
    """What `aten.convolution` holds beside its output when it runs for real (torch.profiler's memory events), and
    the ops it ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        out = torch.ops.aten.convolution.default(*args)
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak - out.numel() * out.element_size(), {event.name for event in profiler.events()}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built")
def test_a_small_float32_convolution_runs_slow2d_with_onednn_on():
    """oneDNN on (torch's default): a batch of 1, one group, a 3x3 kernel and at most 20,480 input elements take
    THNN's Slow2d (`ConvParams::use_mkldnn`), with its im2col columns; the rule had taken every float32 convolution
    for oneDNN's and counted 0 (72 KiB low here)."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes

    args = (torch.randn(1, 8, 16, 16), torch.randn(8, 8, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    with torch.backends.mkldnn.flags(enabled=True):
        measured, ran = _op_scratch_measured(args)
        predicted = kernel_scratch_bytes(torch.ops.aten.convolution.default, args, {}, "cpu")
    assert "aten::thnn_conv2d" in ran
    assert predicted == measured == 8 * 9 * 256 * 4


def test_one_element_convolution_parameters_stand_for_every_dimension():
    """`aten.convolution` expands a one-element stride, padding or dilation (expand_param_if_needed): the rule reads
    them so, where it had raised an IndexError inside the trace."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes

    full = (torch.randn(1, 8, 16, 16, dtype=torch.float64), torch.randn(8, 8, 3, 3, dtype=torch.float64), None)
    short = (*full, [1], [1], [1], False, [0], 1)
    measured, _ = _op_scratch_measured(short)
    assert kernel_scratch_bytes(torch.ops.aten.convolution.default, short, {}, "cpu") == measured > 0
