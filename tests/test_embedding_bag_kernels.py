"""The CPU EmbeddingBag kernels' own temporaries (memplan.estimator.composite_kernels.embedding_bag): offset2bag and
its cumsum, the backward's sort of the indices, a max backward's gathered rows, which no dispatch mode sees; and
offset2bag's [N + 1] storage (memplan.estimator.oprules: the fake kernel's is [N]).

Truth: a plain step run for real on the CPU, measured by the CPU allocator's own events (tests/hand_measure.py), and
op by op with torch.profiler. Before the rules, these steps were 3.1-5.8 KiB low (a sum's backward made offset2bag and
sorted the indices beside its 38,400 B gradient)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.oprules import OUTPUT_BYTES_RULES
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

VOCAB, DIM, PER_SAMPLE, BATCH = 300, 32, 20, 8


class _Bags(torch.nn.Module):
    """An EmbeddingBag over [B, 20] indices (2-D, or flattened with offsets), a linear head, a squared-sum loss."""

    def __init__(self, mode: str, weighted: bool, offsets: bool) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(VOCAB, DIM, mode=mode)
        self.head = torch.nn.Linear(DIM, 4)
        self.weights = torch.nn.Parameter(torch.ones(PER_SAMPLE)) if weighted else None
        self.offsets = offsets

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        weights = None if self.weights is None else self.weights.expand(indices.shape)
        if self.offsets:
            offsets = torch.arange(0, indices.numel(), PER_SAMPLE)
            weights = None if weights is None else weights.reshape(-1)
            bags = self.bag(indices.reshape(-1), offsets, per_sample_weights=weights)
        else:
            bags = self.bag(indices, per_sample_weights=weights)
        return self.head(bags).square().sum()


def _indices(settings, dtype) -> torch.Tensor:
    return torch.randint(0, VOCAB, (settings.batch_size, PER_SAMPLE), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("mode", "weighted", "offsets"),
    [("sum", False, False), ("sum", True, True), ("mean", False, True), ("max", False, False)],
)
def test_an_embedding_bag_step_matches_a_plain_run(mode, weighted, offsets):
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")

    def build():
        torch.manual_seed(0)
        model = _Bags(mode, weighted, offsets)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return training_iteration(model, _indices(settings, None), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("embedding-bag", lambda: _Bags(mode, weighted, offsets), (PER_SAMPLE,))
    spec = dataclasses.replace(spec, make_batch=_indices)
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured


def _profiled(call):
    """The op's output and the most bytes the CPU allocator had live while it ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        out = call()
    held = peak = 0
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    for event in sorted(events, key=lambda event: event.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return out, peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize(
    ("mode", "weighted", "padding_idx", "include_last_offset"),
    [
        (0, False, -1, False),
        (0, True, -1, True),
        (0, True, 3, False),
        (1, False, -1, False),
        (1, False, 3, True),
        (2, False, -1, False),
        (2, False, -1, True),
    ],
)
def test_each_embedding_bag_op_holds_what_its_rule_says(
    dtype, index_dtype, mode, weighted, padding_idx, include_last_offset
):
    """Forward, backward and per-sample-weights backward, each run on real tensors under torch.profiler, against its
    output-bytes and scratch rules read from fake tensors (the fake forward's outputs feeding the fake backward, as in
    a trace: a bfloat16 sum's fake offset2bag is [N] where the CPU's is empty)."""
    torch.manual_seed(0)
    count = 160
    weight = torch.randn(VOCAB, DIM, dtype=dtype)
    indices = torch.randint(0, VOCAB, (count,), dtype=index_dtype)
    offsets = torch.arange(0, count + (1 if include_last_offset else 0), PER_SAMPLE, dtype=index_dtype)
    weights = torch.randn(count, dtype=dtype) if weighted else None
    forward, backward = torch.ops.aten._embedding_bag.default, torch.ops.aten._embedding_bag_backward.default
    per_sample_backward = torch.ops.aten._embedding_bag_per_sample_weights_backward.default
    args = (weight, indices, offsets, False, mode, False, weights, include_last_offset, padding_idx)
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fake = lambda value: fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value  # noqa: E731
    fake_args = tuple(fake(arg) for arg in args)
    with fake_mode:
        fake_out = forward(*fake_args)

    out, peak = _profiled(lambda: forward(*args))
    output_bytes = OUTPUT_BYTES_RULES[forward](fake_args, {}, "cpu")
    assert output_bytes == [tensor.untyped_storage().nbytes() for tensor in out]
    assert sum(output_bytes) + kernel_scratch_bytes(forward, fake_args, {}, "cpu") == peak

    grad = torch.randn(out[0].shape, dtype=dtype)
    calls = [
        (
            backward,
            (grad, indices, offsets, *out[1:], VOCAB, False, mode, False, weights, padding_idx),
            (
                fake(grad),
                fake_args[1],
                fake_args[2],
                *fake_out[1:],
                VOCAB,
                False,
                mode,
                False,
                fake_args[6],
                padding_idx,
            ),
        )
    ]
    if weighted:
        calls.append(
            (
                per_sample_backward,
                (grad, weight, indices, offsets, out[1], mode, padding_idx),
                (fake(grad), *fake_args[:3], fake_out[1], mode, padding_idx),
            )
        )
    for op, real_args, op_fake_args in calls:
        gradient, peak = _profiled(lambda op=op, real_args=real_args: op(*real_args))
        assert gradient.untyped_storage().nbytes() + kernel_scratch_bytes(op, op_fake_args, {}, "cpu") == peak, op
