"""The math path of scaled_dot_product_attention holds its casts, its converted mask and its scaled query until it
returns (memplan.estimator.math_attention). On the CPU, dropout sends attention down that path.

Truth: the step run for real on the CPU (memplan.measure.cpu). Without the rule the two attention blocks below came
out 156,540 B of 2,129,792 low (7.4%) under CPU autocast, 159,612 B (7.5%) with a boolean mask, 281,732 B of
1,540,488 (18.3%) checkpointed under autocast, and 4,100 B checkpointed in float32 (the converted mask, alive in the
real run through the recomputed attention).
"""

import pytest
import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

HEADS, WIDTH = 4, 64


class Attention(nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.masked = masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, steps, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        mask = torch.ones(steps, steps, dtype=torch.bool).tril() if self.masked else None
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        return x + self.out(attended.transpose(1, 2).reshape(batch, steps, WIDTH))


class Blocks(nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(masked) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def attention() -> nn.Module:
    return Blocks(masked=False)


def masked_attention() -> nn.Module:
    return Blocks(masked=True)


def sequences(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 32, WIDTH)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.float().square().mean()


@pytest.mark.parametrize(
    ("model", "precision", "checkpoint"),
    [
        ("attention", "amp-bf16", "none"),
        ("masked_attention", "amp-bf16", "none"),
        ("masked_attention", "fp32", "all"),
        ("masked_attention", "amp-bf16", "all"),
    ],
)
def test_attention_with_dropout_on_the_cpu_is_its_real_run(model, precision, checkpoint):
    spec = resolve_model(
        f"tests.test_math_attention:{model}",
        inputs="tests.test_math_attention:sequences",
        loss="tests.test_math_attention:mean_square",
    )
    settings = TrainingSettings(batch_size=8, device="cpu", optimizer="sgd", precision=precision, checkpoint=checkpoint)
    settings = spec.settings_for(settings)
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    measured = measure_cpu(spec, settings).peak_bytes
    assert abs(predicted - measured) <= 8, f"predicted {predicted:,} B, measured {measured:,} B"


class _MathPathScores(nn.Module):
    """Attention over its own input through the math path (sdpa_kernel(MATH)), no weights before it: the step's peak
    is its forward's `_safe_softmax`, beside the scores and their softmax."""

    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.head, self.masked = nn.Linear(8, 4), masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        steps = x.shape[-2]
        mask = torch.ones(steps, steps, dtype=torch.bool).tril() if self.masked else None
        with sdpa_kernel(SDPBackend.MATH):
            attended = nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        return self.head(attended).square().mean()


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "bool-mask"])
def test_safe_softmax_holds_its_masks_beside_its_output(masked):
    """`_safe_softmax` (memplan.estimator.composite_kernels.safe_softmax) holds a bool per score, a bool per row and
    a 0-d zero beside its output: without the rule memplan and its CPU counter were both 24,964 B low here (a
    [2, 3, 64, 64] float32 score tensor: 24,576 + 384 + 4), against the plain run's allocator events."""
    from tests.hand_measure import profiled_third_iteration_peak, training_iteration
    from tests.module_specs import loss_returning_spec

    batch, heads, steps, width = 2, 3, 64, 8

    def build():
        torch.manual_seed(0)
        model = _MathPathScores(masked)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(batch, heads, steps, width), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("math-path-scores", lambda: _MathPathScores(masked), (heads, steps, width))
    settings = TrainingSettings(batch_size=batch, device="cpu", optimizer="sgd")
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured


def test_safe_softmax_s_requests_on_the_cuda_target():
    """The H100 allocator trace of qwen2.5-0.5b-fp32 (torch 2.11, docs/validation/h100) has, after each [2, 14, 2048,
    2048] float32 softmax output, requests of 117,440,512 B, 57,344 B and 4 B, freed as the call returns."""
    from memplan.estimator.composite_kernels import kernel_scratch_requests

    scores = torch.empty(2, 14, 2048, 2048, device="meta")
    requests = kernel_scratch_requests(torch.ops.aten._safe_softmax.default, (scores, -1), {}, "cuda")
    assert requests == (2 * 14 * 2048 * 2048, 2 * 14 * 2048, 4)


class _MaskedMathBlocks(nn.Module):
    """Two attention blocks through the math path (sdpa_kernel(MATH)) with an additive mask; the mask variable is
    bound to None at each block's start (a tensor's variable rebound to None once the tensor is gone)."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.qkv, self.mask = nn.ModuleList(nn.Linear(32, 96) for _ in range(2)), mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        batch, steps, _ = x.shape
        for qkv in self.qkv:
            q, k, v = qkv(x).view(batch, steps, 3, 4, 8).permute(2, 0, 3, 1, 4)
            mask = None
            if self.mask == "float":
                mask = torch.zeros(batch, 1, steps, steps)
            with sdpa_kernel(SDPBackend.MATH):
                attended = nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=0.1, is_causal=self.mask == "causal"
                )
            x = x + attended.transpose(1, 2).reshape(batch, steps, 32)
        return x.square().mean()


@pytest.mark.parametrize("mask", ["float", "causal"])
def test_the_math_path_adds_its_mask_in_place(mask):
    """`attn.add_(*attn_mask)` in a plain run, `attn.add(...)` for a subclass (a fake tensor): memplan's trace asked
    for one [2, 4, 64, 64] float32 scores tensor more per block than the plain run's allocator events show (16
    against 14). The peak (the softmax's, after the add) was right either way; the CUDA allocator's requests not."""
    from memplan.estimator.liveness import liveness
    from tests.hand_measure import allocator_events, profiled_third_iteration, training_iteration, window
    from tests.module_specs import loss_returning_spec

    batch, steps = 2, 64
    scores = batch * 4 * steps * steps * 4

    def build():
        torch.manual_seed(0)
        model = _MaskedMathBlocks(mask)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(batch, steps, 32), lambda out, _: out, optimizer)

    recording = profiled_third_iteration(build)
    start, end = window(recording, "measured")
    measured = sum(
        1 for event in allocator_events(recording) if start <= event.start_ns() <= end and event.nbytes() == scores
    )
    spec = loss_returning_spec("masked-math", lambda: _MaskedMathBlocks(mask), (steps, 32))
    traced = trace_step(spec, TrainingSettings(batch_size=batch, device="cpu", optimizer="sgd"))
    assert sum(1 for size in liveness(traced).size.values() if size == scores) == measured == 14


class _SlicedHead(nn.Module):
    """A biased head over a sliced (non-contiguous) input: at::linear's at::matmul path, then the bias."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x[:, 1:, :]).mean()


def test_linear_adds_its_bias_in_place_as_a_plain_run_does():
    """at::linear adds the bias with `output.add_(*bias)` unless the bias is a subclass (a fake tensor): memplan
    held two [4, 15, 2048] outputs at once, 1,130,240 B predicted against the plain run's 777,992 B (+45%)."""
    from tests.hand_measure import profiled_third_iteration_peak, training_iteration
    from tests.module_specs import loss_returning_spec

    def build():
        torch.manual_seed(0)
        model = _SlicedHead()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(4, 16, 16), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("sliced-head", _SlicedHead, (16, 16))
    settings = TrainingSettings(batch_size=4, device="cpu", optimizer="sgd")
    assert simulate(trace_step(spec, settings)).peak_bytes == measured


def test_validate_s_counter_takes_linear_s_plain_path_too():
    """Under a dispatch mode at::linear takes its subclass branch as under fake tensors (isTensorSubclassLike checks
    dispatch_mode_enabled): validate's counter, over a real run, read 1,130,240 B where the run's own allocator
    holds 777,992 B at most."""
    from memplan.measure.cpu import measure_cpu
    from tests.hand_measure import profiled_third_iteration_peak, training_iteration
    from tests.module_specs import loss_returning_spec

    def build():
        torch.manual_seed(0)
        model = _SlicedHead()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(4, 16, 16), lambda out, _: out, optimizer)

    spec = loss_returning_spec("sliced-head", _SlicedHead, (16, 16))
    settings = TrainingSettings(batch_size=4, device="cpu", optimizer="sgd")
    assert measure_cpu(spec, settings).peak_bytes == profiled_third_iteration_peak(build) == 777_992
