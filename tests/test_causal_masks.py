"""memplan.estimator.causal_masks: nn.TransformerEncoder / nn.TransformerDecoder given a mask and no `is_causal` test
the mask's values (torch/nn/modules/transformer.py, _detect_is_causal_mask). Before, memplan refused the usual way to
train them, `encoder(x, mask=nn.Transformer.generate_square_subsequent_mask(n))`, as data-dependent control flow in
the user's code (a helper's hunt).

Truth: the same step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's own events
(tests/hand_measure.py, torch.profiler)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.errors import TraceError
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import ModelRef, ModelSpec
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration

BATCH, POSITIONS, WIDTH, HEADS = 4, 16, 32, 4


def _mask(kind: str) -> torch.Tensor:
    if kind == "causal":
        return nn.Transformer.generate_square_subsequent_mask(POSITIONS)
    if kind == "bool-causal":
        return torch.ones(POSITIONS, POSITIONS, dtype=torch.bool).triu(1)
    # not causal: each position hidden from those two and more before it
    return torch.zeros(POSITIONS, POSITIONS).masked_fill(
        torch.ones(POSITIONS, POSITIONS, dtype=torch.bool).tril(-2), -1e4
    )


class _Encoder(nn.Module):
    """A two-layer encoder given a mask it makes itself, with no is_causal hint (the module's default, None)."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, mask=_mask(self.mask)).square().mean()


class _Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Transformer(WIDTH, HEADS, 1, 1, dim_feedforward=64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, x, tgt_mask=_mask("causal")).square().mean()


def _spec(build) -> ModelSpec:
    return ModelSpec(
        ModelRef("masked"),
        lambda settings: build(),
        lambda settings, dtype: torch.randn(settings.batch_size, POSITIONS, WIDTH),
        lambda output, batch: output,
        lambda settings: settings,
    )


def _plain_run_peak(build) -> int:
    def make():
        torch.manual_seed(0)
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, torch.randn(BATCH, POSITIONS, WIDTH), lambda out, _: out, optimizer)

    return profiled_third_iteration_peak(make)


@pytest.mark.parametrize(
    "build",
    [lambda: _Encoder("causal"), lambda: _Encoder("bool-causal"), lambda: _Encoder("not-causal"), _Seq2Seq],
    ids=["causal", "bool-causal", "not-causal", "nn.Transformer"],
)
def test_a_mask_without_is_causal_is_read_as_the_real_run_reads_it(build):
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    assert simulate(trace_step(_spec(build), settings)).peak_bytes == _plain_run_peak(build)


class _BatchMasked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, mask=mask).square().mean()


def test_a_mask_from_the_batch_is_refused_naming_the_hint():
    spec = ModelSpec(
        ModelRef("batch-masked"),
        lambda settings: _BatchMasked(),
        lambda settings, dtype: (torch.randn(settings.batch_size, POSITIONS, WIDTH), _mask("causal")),
        lambda output, batch: output,
        lambda settings: settings,
    )
    with pytest.raises(TraceError, match="is_causal=True or False"):
        trace_step(spec, TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd"))


class _LongEncoder(nn.Module):
    """One layer over 4,097 positions, its causal mask made of constants: past what memplan replays for real."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1])).square().mean()


def test_a_mask_past_4096_positions_is_not_replayed_and_the_hint_is_asked_for():
    """Replaying a (positions, positions) mask with real values holds several such masks in memplan's own process
    (1.1 GiB at 8,192 positions, found by a review): past 4,096 the hint is asked for instead."""
    spec = ModelSpec(
        ModelRef("long-masked"),
        lambda settings: _LongEncoder(),
        lambda settings, dtype: torch.randn(settings.batch_size, 4097, 8),
        lambda output, batch: output,
        lambda settings: settings,
    )
    with pytest.raises(TraceError, match="larger than the 4,096 x 4,096"):
        trace_step(spec, TrainingSettings(batch_size=1, device="cpu", optimizer="sgd"))


class _BufferMasked(nn.Module):
    """The causal mask registered as a buffer, made once in __init__ of constants (nanoGPT's and minGPT's way, here
    handed to nn.TransformerEncoder with no is_causal hint), sliced to the sequence in forward; float or bool."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        if kind == "float":  # 0 kept, -inf hidden, from tril of ones as nanoGPT makes its mask
            ones = torch.tril(torch.ones(2 * POSITIONS, 2 * POSITIONS))
            self.register_buffer("mask", torch.zeros_like(ones).masked_fill(ones == 0, float("-inf")))
        elif kind == "bool":
            self.register_buffer("mask", torch.ones(2 * POSITIONS, 2 * POSITIONS, dtype=torch.bool).triu(1))
        else:  # written in place after it was made: still constants, replayed as they were written
            self.register_buffer("mask", torch.full((2 * POSITIONS, 2 * POSITIONS), float("-inf")).triu_(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = x.shape[1]
        return self.encoder(x, mask=self.mask[:positions, :positions]).square().mean()


@pytest.mark.parametrize("kind", ["float", "bool", "in-place"])
def test_a_causal_mask_buffer_made_of_constants_is_read(kind):
    """Before, a buffer had no values under fake tensors and the mask was refused (memplan.estimator.buffer_values)."""
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    predicted = simulate(trace_step(_spec(lambda: _BufferMasked(kind)), settings)).peak_bytes
    assert predicted == _plain_run_peak(lambda: _BufferMasked(kind))


class _RandomBufferMasked(_BufferMasked):
    def __init__(self) -> None:
        super().__init__("bool")
        self.mask = torch.rand(2 * POSITIONS, 2 * POSITIONS) > 0.5  # random values: no constants to replay


def test_a_buffer_not_made_of_constants_is_still_refused_naming_the_hint():
    with pytest.raises(TraceError, match="is_causal=True or False"):
        trace_step(_spec(_RandomBufferMasked), TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd"))


class _ForeachZeroedMasked(_BufferMasked):
    def __init__(self) -> None:
        super().__init__("bool")
        torch._foreach_zero_([self.mask])  # a Tensor[] argument written in place: no longer the triu it was made as


def test_a_buffer_written_through_a_tensor_list_is_not_replayed_as_it_was_made():
    """Before, a write through a Tensor(a!)[] argument was not counted, and the zeroed mask replayed as its triu."""
    with pytest.raises(TraceError, match="is_causal=True or False"):
        trace_step(_spec(_ForeachZeroedMasked), TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd"))
