"""memplan.estimator.composite_kernels.batch_norm: the per-channel temporaries the CPU batch norm kernels hold inside
themselves (alpha/beta, the collect-stats `_mean`/`_var_sum` and per-thread buffer, the backward's channels-last
buffers), which no dispatch mode sees.

Truth: the CPU allocator's own events (torch.profiler) in a plain run with no dispatch mode active
(tests/hand_measure.py), kernel by kernel and for a whole frozen-backbone step. Before the rules the forward held
nothing beside its outputs (384 B low for C=48, 768 B channels-last training) and a 2-D input's backward only its
replaced grad_input (a (4, 48) float32 one without weight: 960 B held, 768 B predicted).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.hand_measure import held_beside_outputs, profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

FORWARD = torch.ops.aten.native_batch_norm.default
BACKWARD = torch.ops.aten.native_batch_norm_backward.default
C = 48
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


def _input(shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(*shape).to(dtype)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "pooled_channels_last":  # [N, C, 1, 1] with channels-last strides: contiguous both ways
        return torch.empty(shape, dtype=dtype, memory_format=torch.channels_last).normal_()
    if layout == "moved":  # (N, L, C) moved to (N, C, L): contiguous in no format
        return torch.randn(shape[0], *shape[2:], shape[1]).to(dtype).movedim(-1, 1)
    return x


CASES = [
    (shape, layout)
    for shape, layout in [
        ((4, C, 5, 5), "contiguous"),
        ((4, C, 5, 5), "channels_last"),
        # a pooled map after a channels-last backbone: its strides' order says channels-last where its contiguity says
        # both (the forward's output, and so the gradient, comes back in the default format's strides)
        ((4, C, 1, 1), "pooled_channels_last"),
        ((4, C), "contiguous"),
        ((4, C, 7), "contiguous"),
        ((4, C, 7), "moved"),
    ]
]


MODES = list(itertools.product([True, False], [True, False], DTYPES))


@pytest.mark.parametrize(("shape", "layout"), CASES)
@pytest.mark.parametrize(("training", "affine", "dtypes"), MODES)
def test_batch_norm_kernels_hold_what_the_allocator_sees(shape, layout, training, affine, dtypes):
    dtype, param_dtype = dtypes
    x = _input(shape, layout, dtype)
    weight = torch.randn(C, dtype=param_dtype) if affine else None
    bias = torch.randn(C, dtype=param_dtype) if affine else None
    running_mean, running_var = torch.zeros(C, dtype=param_dtype), torch.ones(C, dtype=param_dtype)
    args = (x, weight, bias, running_mean, running_var, training, 0.1, 1e-5)
    assert kernel_scratch_bytes(FORWARD, args, {}, "cpu") == held_beside_outputs(lambda: FORWARD(*args))
    output, save_mean, save_invstd = FORWARD(*args)
    grad = torch.randn_like(output)
    backward_args = (grad, x, weight, running_mean, running_var, save_mean, save_invstd, training, 1e-5)
    backward_args += ([True, affine, affine],)
    assert kernel_scratch_bytes(BACKWARD, backward_args, {}, "cpu") == held_beside_outputs(
        lambda: BACKWARD(*backward_args)
    )


class _FrozenBackbone(nn.Module):
    """A frozen conv + batch norm backbone (evaluation mode) under a trained head, and a trained batch norm on 2-D
    features: both kernels' per-channel temporaries sit at the step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C), nn.ReLU()).requires_grad_(False)
        self.backbone.eval()
        self.head = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C), nn.Linear(C, 1))

    def train(self, mode: bool = True) -> _FrozenBackbone:
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.backbone(x).mean((2, 3))
        return self.head(features).square().mean()


def _plain_run_peak(batch: int) -> int:
    def build():
        torch.manual_seed(0)
        model = _FrozenBackbone()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        return training_iteration(model, torch.randn(batch, 3, 6, 6), lambda out, _: out, optimizer)

    with torch.backends.mkldnn.flags(enabled=False):
        return profiled_third_iteration_peak(build)


def test_a_frozen_batch_norm_backbone_step_matches_a_plain_run():
    spec = loss_returning_spec("frozen-bn", _FrozenBackbone, (3, 6, 6))
    settings = TrainingSettings(batch_size=4, device="cpu", optimizer="sgd")
    with torch.backends.mkldnn.flags(enabled=False):
        predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert predicted == _plain_run_peak(4)
