"""memplan.estimator.composite_kernels.reductions: what the CPU's 16-bit sums, logsumexp, scans, norms and softmax
kernels hold inside themselves (float32 accumulation buffers, dtype casts, contiguous copies), which no dispatch
mode sees.

Truth: the CPU allocator's own events (torch.profiler) with no dispatch mode active (tests/hand_measure.py), kernel
by kernel and for whole bfloat16 steps. Before the rules, a bfloat16 sum of a (4, 48, 7) tensor over dims (0, 2)
held 5,568 B memplan put at 0, its logsumexp over the last dim 3,072 B, a softmax of a transposed input a copy of
it, a float32 var of every element 16 B.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.hand_measure import held_beside_outputs, profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

aten = torch.ops.aten
F32 = {"dtype": torch.float32}


def _call_cases(dtype: torch.dtype, strided: bool) -> list[tuple[str, object, tuple, dict]]:
    x = torch.randn(4, 48, 7).to(dtype)
    if strided:  # a transposed (dense, not contiguous) tensor of the same shape
        x = torch.randn(4, 7, 48).to(dtype).transpose(1, 2)
    x4 = torch.randn(2, 3, 5, 8).to(dtype)
    grad = torch.randn(4, 7, 48).to(dtype).transpose(1, 2)
    cases = [
        ("sum", aten.sum.default, (x,), {}),
        ("sum-dims-0-2", aten.sum.dim_IntList, (x, [0, 2]), {}),
        ("sum-dims-0-1", aten.sum.dim_IntList, (x, [0, 1]), {}),
        ("sum-4d-1-3-keepdim", aten.sum.dim_IntList, (x4, [1, 3], True), {}),
        ("sum-4d-0-3", aten.sum.dim_IntList, (x4, [0, 3]), {}),
        ("sum-4d-transposed-0-1", aten.sum.dim_IntList, (x4.transpose(1, 2), [0, 1]), {}),
        ("sum-float32", aten.sum.dim_IntList, (x, [-1]), F32),
        # a float32 input summed into bfloat16: its 16-bit cast, and the float32 result beside it (no float32 copy)
        ("sum-into-bfloat16", aten.sum.dim_IntList, (x.float(), [0, 2]), {"dtype": torch.bfloat16}),
        ("mean", aten.mean.default, (x,), {}),
        ("mean-dim", aten.mean.dim, (x, [1], True), {}),
        ("var", aten.var.correction, (x,), {}),
        ("std-dim", aten.std.correction, (x, [-1]), {"correction": 0}),
        ("var-mean", aten.var_mean.correction, (x, [-1]), {}),
        ("vector-norm-float32", aten.linalg_vector_norm.default, (x, 2, [-1]), F32),
        ("vector-norm-inf", aten.linalg_vector_norm.default, (x, float("inf"), [1]), {}),
        ("norm-float32", aten.norm.ScalarOpt_dim_dtype, (x, 2, [-1], False), F32),
        ("logsumexp", aten.logsumexp.default, (x, [-1]), {}),
        ("logsumexp-keepdim", aten.logsumexp.default, (x, [1], True), {}),
        ("logsumexp-4d-0-2", aten.logsumexp.default, (x4, [0, 2]), {}),
        ("amax", aten.amax.default, (x, [-1]), {}),
        ("max", aten.max.default, (x,), {}),
        ("min", aten.min.default, (x,), {}),
        ("prod-float32", aten.prod.dim_int, (x, 1), F32),
        ("cumsum", aten.cumsum.default, (x, 1), {}),
        ("cumsum-float32", aten.cumsum.default, (x, 1), F32),
        ("cumsum-bool", aten.cumsum.default, (x > 0, -1), {}),
        ("cumprod-float32", aten.cumprod.default, (x, -1), F32),
        ("softmax", aten._softmax.default, (x, -1, False), {}),
        ("log-softmax-dim-1", aten._log_softmax.default, (x, 1, False), {}),
    ]
    for dim in (-1, 1):
        output = aten._softmax.default(x, dim, False)
        cases.append((f"softmax-backward-{dim}", aten._softmax_backward_data.default, (grad, output, dim, dtype), {}))
        log_output = aten._log_softmax.default(x, dim, False).transpose(0, 1).contiguous().transpose(0, 1)
        args = (grad.contiguous(), log_output, dim, dtype)
        cases.append((f"log-softmax-backward-{dim}", aten._log_softmax_backward_data.default, args, {}))
    return cases


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_reduction_kernels_hold_what_the_allocator_sees(dtype, strided):
    wrong = {}
    for name, op, args, kwargs in _call_cases(dtype, strided):
        measured = held_beside_outputs(lambda op=op, args=args, kwargs=kwargs: op(*args, **kwargs))
        predicted = kernel_scratch_bytes(op, args, kwargs, "cpu")
        if predicted != measured:
            wrong[name] = (measured, predicted)
    assert not wrong, f"(measured, predicted) bytes: {wrong}"


BATCH, POSITIONS, FEATURES, WIDTH = 4, 8, 16, 256


class _Reducing(torch.nn.Module):
    """y's mean square, plus nothing times a reduction of a tensor 16 times y's size (the step's peak there)."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.linear, self.reduction = torch.nn.Linear(FEATURES, WIDTH), reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        wide = y.detach().unsqueeze(-1).expand(*y.shape, 16) * 1
        if self.reduction == "sum-over-rows":  # (batch, width) sums: a float32 copy of all of it
            reduced = wide.sum((0, 2)).sum()
        elif self.reduction == "logsumexp":
            reduced = wide.logsumexp(-1).sum()
        elif self.reduction == "softmax-transposed":
            reduced = wide.transpose(1, 2).softmax(-1).sum()
        else:
            raise ValueError(self.reduction)
        return y.pow(2).mean() + 0 * reduced


# The CPU's reductions split over threads keep each thread's partial result (tests/test_composite_kernels.py)
THREAD_PARTIALS = 16


@pytest.mark.parametrize("reduction", ["sum-over-rows", "logsumexp", "softmax-transposed"])
def test_a_bf16_step_holds_its_reductions_scratch(reduction):
    def build():
        torch.manual_seed(0)
        model = _Reducing(reduction).to(torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(BATCH, POSITIONS, FEATURES, dtype=torch.bfloat16)
        return training_iteration(model, batch, lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec(f"{reduction}-loss", lambda: _Reducing(reduction), (POSITIONS, FEATURES))
    spec = dataclasses.replace(
        spec, make_batch=lambda settings, dtype: torch.randn(settings.batch_size, POSITIONS, FEATURES, dtype=dtype)
    )
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd", precision="bf16")
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert measured - THREAD_PARTIALS <= predicted <= measured


@pytest.mark.parametrize("shape", [(2, 8, 6, 6), (2, 8, 12)], ids=["2d", "1d"])
@pytest.mark.parametrize("output_mask", [[True, True, True], [True, False, True], [False, False, True]], ids=str)
def test_a_16_bit_convolution_backward_sums_its_bias_gradient_in_float32(shape, output_mask):
    """The Slow2d backward's bias gradient is `at::sum_out(grad_bias, grad_output, {0, 2, 3})`: for a bfloat16
    gradient the batch and spatial dimensions are both reduced, so the sum takes float32 copies (4,672 B beside a
    [2, 16, 6, 6] gradient's 32 B bias gradient, memplan had 0 where neither other gradient is asked for)."""
    spatial = len(shape) - 2
    x = torch.randn(*shape).to(torch.bfloat16)
    weight = torch.randn(16, shape[1], *[3] * spatial).to(torch.bfloat16)
    grad = torch.randn(shape[0], 16, *shape[2:]).to(torch.bfloat16)
    ones, zeros = [1] * spatial, [0] * spatial
    args = (grad, x, weight, [16], ones, ones, ones, False, zeros, 1, output_mask)
    op = aten.convolution_backward.default
    with torch.backends.mkldnn.flags(enabled=False):  # the Slow2d backend (the rule reads the same flag)
        assert kernel_scratch_bytes(op, args, {}, "cpu") == held_beside_outputs(lambda: op(*args))
