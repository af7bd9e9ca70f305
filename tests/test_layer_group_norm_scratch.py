"""memplan.estimator.composite_kernels.layer_group_norm: the temporaries the CPU layer norm and group norm kernels
hold inside themselves (layer norm's per-thread dgamma/dbeta rows and contiguous copies, group norm's internal
gradients and channels-last buffers), which no dispatch mode sees.

Truth: the CPU allocator's own events (torch.profiler) in a plain run with no dispatch mode active
(tests/hand_measure.py), kernel by kernel and for whole steps. Before the rules every one of these kernels was
predicted to hold nothing: a [4, 6, 32] float32 layer norm backward holds 512 B (2 threads), 3,584 B with a
transposed input; a [4, 32, 5, 5] group norm backward 1,024 B; and three of the four whole steps below came
out low (the layer norm net by 6,592 B in float32, the group norm net by 1,024 B; the bfloat16 group norm net peaks
elsewhere).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import ModelRef, ModelSpec
from memplan.settings import TrainingSettings
from tests.hand_measure import held_beside_outputs, profiled_third_iteration_peak, training_iteration

A = torch.ops.aten
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


def _params(size: int, dtype: torch.dtype, affine: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (torch.randn(size, dtype=dtype), torch.randn(size, dtype=dtype)) if affine else (None, None)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded_grad"])
@pytest.mark.parametrize(
    ("shape", "affine", "dtypes"), list(itertools.product([(4, 6, 32), (3, 100)], [True, False], DTYPES))
)
def test_layer_norm_kernels_hold_what_the_allocator_sees(shape, affine, dtypes, layout):
    dtype, param_dtype = dtypes
    n = shape[-1]
    x = torch.randn(*shape).to(dtype)
    if layout == "transposed":  # a view contiguous in no order the kernel reads: expect_contiguous copies it
        x = torch.randn(*shape[:-2], n, shape[-2]).to(dtype).transpose(-1, -2)
    weight, bias = _params(n, param_dtype, affine)
    args = (x, [n], weight, bias, 1e-5)
    assert kernel_scratch_bytes(A.native_layer_norm.default, args, {}, "cpu") == held_beside_outputs(
        lambda: A.native_layer_norm.default(*args)
    )
    out, mean, rstd = A.native_layer_norm.default(*args)
    grad = torch.randn_like(out)
    if layout == "expanded_grad":  # what a sum over the rows hands back: `dY.contiguous()` copies it
        grad = torch.ones(*shape[:-1], 1, dtype=dtype).expand(*shape)
    for mask in {(True, affine, affine), (False, affine, affine)}:
        backward_args = (grad, x, [n], mean, rstd, weight, bias, list(mask))
        if not any(mask):
            continue
        assert kernel_scratch_bytes(A.native_layer_norm_backward.default, backward_args, {}, "cpu") == (
            held_beside_outputs(lambda b=backward_args: A.native_layer_norm_backward.default(*b))
        )


GROUP_CASES = [((4, 32, 5, 5), 8), ((4, 32, 7), 4), ((4, 32, 5, 5), 32), ((2, 16, 48, 48), 4)]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(("case", "affine", "dtypes"), list(itertools.product(GROUP_CASES, [True, False], DTYPES)))
def test_group_norm_kernels_hold_what_the_allocator_sees(case, affine, dtypes, channels_last):
    (shape, groups), (dtype, param_dtype) = case, dtypes
    if channels_last and len(shape) != 4:
        pytest.skip("channels-last is 4-D")
    x = torch.randn(*shape).to(dtype)
    if channels_last:  # (2, 16, 48, 48): past both feature_map_thresholds, the per-thread buffers
        x = x.contiguous(memory_format=torch.channels_last)
    n, c = shape[:2]
    hxw = x.numel() // (n * c)
    weight, bias = _params(c, param_dtype, affine)
    args = (x, weight, bias, n, c, hxw, groups, 1e-5)
    assert kernel_scratch_bytes(A.native_group_norm.default, args, {}, "cpu") == held_beside_outputs(
        lambda: A.native_group_norm.default(*args)
    )
    out, mean, rstd = A.native_group_norm.default(*args)
    backward_args = (torch.randn_like(out), x, mean, rstd, weight, n, c, hxw, groups, [True, affine, affine])
    assert kernel_scratch_bytes(A.native_group_norm_backward.default, backward_args, {}, "cpu") == (
        held_beside_outputs(lambda: A.native_group_norm_backward.default(*backward_args))
    )


class _GroupNormNet(nn.Module):
    """A 1x1 conv under two GroupNorms, the second last: its backward runs first, with every activation still held,
    and holds its [N, C] internal gradients there, at the step's peak (a 3x3 conv's backward peaks higher)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 1), nn.GroupNorm(8, 32), nn.ReLU(), nn.GroupNorm(4, 32, affine=False)
        )
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3))).square().mean()


class _LayerNormNet(nn.Module):
    """Pre-norm MLP blocks over tokens, pooled by a sum: the last layer norm's backward gets the sum's expanded
    gradient and copies it (`dY.contiguous()`) beside its per-thread dgamma/dbeta rows."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h).sum(1)).square().mean()


MODELS = {"group_norm": (_GroupNormNet, (3, 6, 6)), "layer_norm": (_LayerNormNet, (256, 8))}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _plain_run_peak(build_model: type[nn.Module], sample: tuple[int, ...], dtype: torch.dtype, batch: int) -> int:
    def build():
        torch.manual_seed(0)
        model = build_model().to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(batch, *sample).to(dtype), lambda out, _: out, optimizer)

    return profiled_third_iteration_peak(build)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", MODELS)
def test_a_normalized_step_matches_a_plain_run(model, precision):
    build_model, sample = MODELS[model]
    spec = ModelSpec(
        ModelRef(model),
        lambda settings: build_model(),
        lambda settings, dtype: torch.randn(settings.batch_size, *sample).to(dtype),
        lambda output, batch: output,
        lambda settings: settings,
    )
    settings = TrainingSettings(batch_size=4, device="cpu", optimizer="sgd", precision=precision)
    with torch.backends.mkldnn.flags(enabled=False):
        predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert predicted == _plain_run_peak(build_model, sample, PRECISIONS[precision], 4)
