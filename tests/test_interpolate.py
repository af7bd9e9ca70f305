"""Batch sizes answered from two traces' lines: checked against traces of those batch sizes.

The truth for every interpolated figure is a full trace and simulation of the same batch size,
which shares none of the interpolation's arithmetic.
"""

import pytest
import torch

from memplan.estimator.batch_tracer import BatchTracer
from memplan.estimator.cuda.allocator import DEFAULT_CONFIG
from memplan.estimator.interpolate import BatchLines, fit_bytes, phase_fit_bytes, same_requests
from memplan.models.source import ModelRef, ModelSpec, resolve_model
from memplan.settings import TrainingSettings
from tests.zoo_models import WiderForLargeBatches

CASES = {
    "gpt2 cuda": ("gpt2", dict(seq_len=64, gpu="A10G")),
    "gpt2 cpu": ("gpt2", dict(seq_len=64, device="cpu")),
    "resnet cuda, cuDNN band": ("resnet", dict(image_size=32, gpu="A100-40GB")),
    "gpt2 checkpointed amp": ("gpt2", dict(seq_len=64, checkpoint="all", precision="amp-bf16")),
}


def _tracer(tiny_model_dirs, case: str, batch_size: int = 4) -> BatchTracer:
    name, settings = CASES[case]
    spec = resolve_model(tiny_model_dirs[name] if name in tiny_model_dirs else name)
    return BatchTracer(spec, spec.settings_for(TrainingSettings(batch_size=batch_size, **settings)))


@pytest.mark.parametrize("case", list(CASES))
def test_lines_through_two_traces_give_a_third_batch_size_exactly(case, tiny_model_dirs):
    tracer = _tracer(tiny_model_dirs, case)
    cuda = tracer.settings.device == "cuda"
    lines = BatchLines.fit(
        (2, tracer.simulate(2).timeline), (4, tracer.simulate(4).timeline), allocator=DEFAULT_CONFIG if cuda else None
    )
    assert lines is not None
    for batch in (3, 7, 13):  # between the two, and beyond them
        traced = tracer.simulate(batch)
        predicted = lines.timeline_at(batch)
        assert predicted is not None and same_requests(predicted, traced.timeline)
        assert phase_fit_bytes(predicted, tracer.settings) == traced.fit_phase_peaks
        assert fit_bytes(predicted, tracer.settings) == traced.fit_bytes


def test_the_timeline_gives_the_simulations_own_figures(tiny_model_dirs):
    for case in CASES:
        tracer = _tracer(tiny_model_dirs, case)
        simulation = tracer.simulate(4)
        assert max(simulation.timeline.total_bytes()) == simulation.peak_bytes
        assert phase_fit_bytes(simulation.timeline, tracer.settings) == simulation.fit_phase_peaks


def test_lines_refuse_timelines_of_different_shape(tiny_model_dirs):
    plain = _tracer(tiny_model_dirs, "gpt2 cuda").simulate(2).timeline
    checkpointed = _tracer(tiny_model_dirs, "gpt2 checkpointed amp").simulate(4).timeline
    assert BatchLines.fit((2, plain), (4, checkpointed), allocator=DEFAULT_CONFIG) is None
    assert BatchLines.fit((2, plain), (2, plain), allocator=DEFAULT_CONFIG) is None


def test_lines_size_the_embedding_backward_s_partial_sums_anew(tiny_model_dirs):
    """Past 3,072 indices CUDA's embedding backward sums into N / 10 + min(N, V) rows (memplan.estimator.cuda.
    embedding_backward): not affine in the batch, so the lines carry the call and size it at each batch size."""
    spec = resolve_model(tiny_model_dirs["gpt2"])
    tracer = BatchTracer(spec, spec.settings_for(TrainingSettings(batch_size=25, seq_len=128, gpu="A10G")))
    lines = BatchLines.fit((25, tracer.simulate(25).timeline), (31, tracer.simulate(31).timeline), DEFAULT_CONFIG)
    assert lines is not None
    for batch in (26, 29, 40):  # 3,328 to 5,120 indices: the rows' tenth is no line through 25 and 31's
        traced = tracer.simulate(batch).timeline
        partial_sums = [a for a in traced.allocations if a.op == "embedding backward's sort and partial sums"]
        # the tokens' embedding: sorted and original indices, six index arrays, the rows of partial sums (the
        # positions' 128 indices take the feature kernel, which requests nothing)
        assert sum(a.size_bytes > 0 for a in partial_sums) == 9
        predicted = lines.timeline_at(batch)
        assert predicted is not None and same_requests(predicted, traced)


def test_lines_from_below_the_embedding_backward_s_switch_size_its_requests_past_it(tiny_model_dirs):
    """Up to 3,072 indices CUDA's embedding backward requests nothing; past them it sorts and sums. Lines through two
    batch sizes below the switch still give the traced requests above it (a search crossing it once traced every
    point it probed)."""
    spec = resolve_model(tiny_model_dirs["gpt2"])
    tracer = BatchTracer(spec, spec.settings_for(TrainingSettings(batch_size=4, seq_len=128, gpu="A10G")))
    lines = BatchLines.fit((4, tracer.simulate(4).timeline), (8, tracer.simulate(8).timeline), DEFAULT_CONFIG)
    assert lines is not None
    for batch in (24, 25, 40):  # 3,072 indices (the feature kernel), then 3,200 and 5,120 (sort and partial sums)
        traced = tracer.simulate(batch).timeline
        predicted = lines.timeline_at(batch)
        assert predicted is not None and same_requests(predicted, traced)
    partial_sums = [a for a in tracer.simulate(40).timeline.allocations if a.op.startswith("embedding backward")]
    assert sum(a.size_bytes > 0 for a in partial_sums) == 9


def test_lines_size_a_bias_gradient_s_reduction_staging_anew():
    """A Linear's bias gradient sums [batch, 64] over the batch: up to about 2,048 rows CUDA's reduction needs no
    staging, past them a buffer in blocks per output (memplan.estimator.cuda.reductions), no line in the batch.
    Lines through two batch sizes without staging give the traced requests of those with it."""
    spec = ModelSpec(
        ModelRef("one-linear"),
        lambda settings: torch.nn.Linear(64, 64),
        lambda settings, dtype: torch.randn(settings.batch_size, 64, dtype=dtype),
        lambda output, batch: output.sum(),
        lambda settings: settings,
    )
    tracer = BatchTracer(spec, TrainingSettings(batch_size=256, optimizer="sgd", gpu="H100-80GB"))
    lines = BatchLines.fit((256, tracer.simulate(256).timeline), (512, tracer.simulate(512).timeline), DEFAULT_CONFIG)
    assert lines is not None
    for batch in (4096, 20_000):
        traced = tracer.simulate(batch).timeline
        staging = [a for a in traced.allocations if a.op.startswith("reduction staging") and a.size_bytes]
        assert staging  # the bias gradient's, past the switch
        predicted = lines.timeline_at(batch)
        assert predicted is not None and same_requests(predicted, traced)


def test_the_search_answers_from_confirmed_lines_and_its_answer_holds(tiny_model_dirs):
    tracer = _tracer(tiny_model_dirs, "gpt2 cuda", batch_size=8)
    # the search stays under 3,072 tokens, where CUDA's embedding backward takes another path (its lines differ)
    budget = 2 * tracer.simulate(8).fit_bytes
    found = tracer.max_batch_size(budget)
    assert tracer.lines is not None and tracer.interpolated  # the lines answered part of the search
    assert len(tracer.simulations) == 3  # the estimate's two traces and the one that confirmed the lines
    check = _tracer(tiny_model_dirs, "gpt2 cuda", batch_size=8)  # fresh traces, no lines
    assert check.simulate(found).fit_bytes <= budget < check.simulate(found + 1).fit_bytes


def test_lines_a_third_trace_contradicts_are_not_used():
    spec = ModelSpec(
        ModelRef("wider-for-large-batches"),
        lambda settings: WiderForLargeBatches(),
        lambda settings, dtype: torch.randn(settings.batch_size, 64),
        lambda output, batch: output,
        lambda settings: settings,
    )
    tracer = BatchTracer(spec, TrainingSettings(batch_size=4, optimizer="sgd", gpu="A10G"))
    for batch in (4, 2, 9):
        tracer.simulate(batch)
    assert tracer.lines is None  # 9 is not on the line through 2 and 4
    budget = tracer.simulate(9).fit_bytes + 1
    found = tracer.max_batch_size(budget)
    assert not tracer.interpolated  # every size the search asked about was traced
    assert tracer.simulate(found).fit_bytes <= budget < tracer.simulate(found + 1).fit_bytes
