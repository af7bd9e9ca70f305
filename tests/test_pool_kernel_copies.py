"""memplan.estimator.composite_kernels' pooling rules: the CPU 2-D pooling kernels copy each tensor not contiguous in
the memory format they run in (the input's forward, the gradient's backward), which no dispatch mode sees.

Truth: torch.profiler's CPU allocator events, of one op (the rule's figure) and of a whole step run for real with no
dispatch mode active (tests/hand_measure.py). Before the rules, the channels-last steps here were 24-41 KiB low."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.hand_measure import held_beside_outputs, profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

aten = torch.ops.aten
SHAPE = (4, 8, 16, 16)


def _channels_last(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous(memory_format=torch.channels_last)


LAYOUTS = {
    "contiguous": lambda t: t,
    "channels-last": _channels_last,
    "transposed": lambda t: t.transpose(2, 3),
    "sliced": lambda t: _channels_last(t)[:, :, ::2],
}


@pytest.mark.parametrize("input_layout", list(LAYOUTS))
@pytest.mark.parametrize("grad_layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("pool", ["max", "avg", "adaptive-avg"])
def test_each_pooling_rule_gives_what_the_kernel_holds(pool, input_layout, grad_layout):
    input = LAYOUTS[input_layout](torch.randn(*SHAPE))
    if pool == "max":
        _, indices = aten.max_pool2d_with_indices(input, [2, 2], [2, 2])
        forward = (aten.max_pool2d_with_indices.default, (input, [2, 2], [2, 2]))
        backward_args = lambda grad: (grad, input, [2, 2], [2, 2], [0, 0], [1, 1], False, indices)  # noqa: E731
        backward = aten.max_pool2d_with_indices_backward.default
    elif pool == "avg":
        forward = (aten.avg_pool2d.default, (input, [3, 3], [2, 2], [1, 1]))
        backward_args = lambda grad: (grad, input, [3, 3], [2, 2], [1, 1], False, True, None)  # noqa: E731
        backward = aten.avg_pool2d_backward.default
    else:
        forward = (aten._adaptive_avg_pool2d.default, (input, [5, 5]))
        backward_args = lambda grad: (grad, input)  # noqa: E731
        backward = aten._adaptive_avg_pool2d_backward.default
    output = forward[0](*forward[1])
    output = output[0] if isinstance(output, tuple) else output
    grad = LAYOUTS[grad_layout](torch.randn(output.shape))
    for op, args in [forward, (backward, backward_args(grad))]:
        assert kernel_scratch_bytes(op, args, {}, "cpu") == held_beside_outputs(lambda op=op, args=args: op(*args)), op


class _PoolChannelsLast(torch.nn.Module):
    """A per-channel scale, then a pooling of the channels-last feature map: the loss's gradient comes back in the
    default format, so the pooling's backward runs in it and copies its channels-last gradient (and indices)."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.pool = pool
        self.scale = torch.nn.Parameter(torch.ones(SHAPE[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _channels_last(x * self.scale.view(1, -1, 1, 1))
        if self.pool == "max":
            y = F.max_pool2d(h, 2)
        elif self.pool == "avg":
            y = F.avg_pool2d(h, 3, 2, 1)
        else:
            y = F.adaptive_avg_pool2d(h, 5)
        return y.square().mean()


@pytest.mark.parametrize("pool", ["max", "avg", "adaptive-avg"])
def test_a_channels_last_pooling_step_is_exact(pool):
    def build():
        torch.manual_seed(0)
        model = _PoolChannelsLast(pool)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(*SHAPE), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec(f"{pool}-pool", lambda: _PoolChannelsLast(pool), SHAPE[1:])
    settings = TrainingSettings(batch_size=SHAPE[0], device="cpu", optimizer="sgd")
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
