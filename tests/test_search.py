"""The max-batch search on synthetic piecewise-linear peaks, counting the traces it spends."""

from memplan.estimator.search import find_max_batch_size


def _search(peak_of, budget, start=(8, 4)):
    calls = []

    def trace_at(batch):
        calls.append(batch)
        return peak_of(batch)

    known = {batch: peak_of(batch) for batch in start}
    return find_max_batch_size(known, trace_at, budget), calls


def linear(batch):
    return {"forward": 1000 + 90 * batch, "backward": 1000 + 100 * batch, "optimizer": 1500}


def test_linear_peaks_need_one_confirming_trace():
    # 1000 + 100 b <= 5000 -> b = 40
    best, calls = _search(linear, 5000)
    assert best == 40
    assert calls == [40]


def test_a_device_figure_that_falls_from_one_batch_to_the_next_is_galloped_from_not_jumped_past():
    """A cuda step's least device memory is a step function of the batch: it fell by 2 MiB from batch 1 to 2
    (llama-3.2-1b, amp-bf16, expandable segments), the fitted line had no slope, and the search traced the
    largest batch memplan models (2^20), which the allocator's replay could not hold."""

    def falls_then_grows(batch):
        return {"device": 1000 - 2 * batch if batch <= 2 else 996 + 100 * (batch - 2)}

    best, calls = _search(falls_then_grows, 1700, start=(1, 2))
    assert best == 9  # 996 + 700 fits, 996 + 800 does not
    assert max(calls) <= 16  # doubled from 2 until over the budget, then bisected back


def test_flat_phase_above_budget_means_nothing_fits():
    best, _ = _search(linear, 1400)
    assert best == 0


def test_piecewise_peaks_are_searched_until_bracketed():
    def piecewise(batch):
        extra = 0 if batch < 20 else 50 * (batch - 20)  # steeper above 20
        return {"backward": 1000 + 100 * batch + extra}

    best, calls = _search(piecewise, 5000)
    expected = max(b for b in range(1, 200) if piecewise(b)["backward"] <= 5000)
    assert best == expected
    assert len(calls) <= 6


def _confirm(fits_up_to, found, limit=None):
    from memplan.estimator.search import MAX_BATCH_SIZE, last_fitting_from

    probes = []

    def fits(batch):
        probes.append(batch)
        return batch <= fits_up_to

    return last_fitting_from(found, fits, limit or MAX_BATCH_SIZE), probes


def test_confirming_above_a_stalled_search_costs_log_traces():
    # A reserved peak flat for 5,000 batch sizes above where a fitted line stopped: the answer is
    # 5,003, found in at most 2 * log2(5,000) + 2 traces instead of 5,000.
    best, probes = _confirm(5003, found=3)
    assert best == 5003
    assert len(probes) <= 2 * 13 + 2
    assert len(set(probes)) == len(probes)


def test_confirming_a_right_answer_costs_one_trace():
    best, probes = _confirm(40, found=40)
    assert (best, probes) == (40, [41])


def test_the_limit_fitting_is_reported_as_the_limit():
    best, probes = _confirm(10**9, found=3, limit=1000)
    assert best == 1000 and probes[-1] == 1000


def _threshold(edge: int, asked: list[int]):  # type: ignore[no-untyped-def]
    """Sizes up to `edge` fit; records every size asked about."""

    def fits(size: int) -> bool:
        asked.append(size)
        return size <= edge

    return fits


def test_the_largest_fitting_size_is_found_from_above_and_below_and_at_the_limits():
    from memplan.estimator.search import largest_fitting

    for start, edge, limit in [(32, 27, 128), (32, 100, 128), (32, 500, 128), (32, 0, 128), (1, 1, 1), (7, 7, 9)]:
        asked: list[int] = []
        assert largest_fitting(start, _threshold(edge, asked), limit) == min(edge, limit), (start, edge, limit)
        assert all(1 <= size <= limit for size in asked)
    # From 128 to an edge of 2,000 within 1,048,576: doubling to 256, 512, 1,024 and 2,048, then
    # bisecting the 1,024 between the last two (10 questions), 15 in all with the start.
    asked = []
    assert largest_fitting(128, _threshold(2_000, asked), 1 << 20) == 2_000
    assert asked[:6] == [128, 256, 512, 1_024, 2_048, 1_536]
    assert len(asked) == 15


def test_maximize_seq_len_finds_the_last_length_that_fits():
    """Truth: the step traced at the answer and one past it, each on its own."""
    from memplan.api import estimate
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings

    common = {"batch_size": 16, "device": "cpu", "optimizer": "sgd"}
    budget = 24 * 2**20  # tiny-gpt2 at batch 16 peaks near 13 MiB at sequence 32, 28 MiB at 64
    result = estimate("tiny-gpt2", seq_len=32, budget=budget, maximize="seq-len", **common)
    longest = result.max_seq_len
    assert longest is not None and 32 < longest < 128 and not result.max_seq_len_is_limit
    spec = resolve_model("tiny-gpt2")

    def peak(seq_len: int) -> int:
        return simulate(trace_step(spec, spec.settings_for(TrainingSettings(seq_len=seq_len, **common)))).peak_bytes

    assert peak(longest) <= budget < peak(longest + 1)


def test_maximize_seq_len_is_refused_without_a_budget_or_a_sequence():
    import pytest

    from memplan.api import estimate
    from memplan.errors import SettingsError

    with pytest.raises(SettingsError, match="needs a budget"):
        estimate("tiny-gpt2", batch_size=2, seq_len=32, device="cpu", maximize="seq-len")
    with pytest.raises(SettingsError, match="resnet-50 takes no sequence length"):
        estimate("resnet-50", batch_size=2, budget="4GiB", maximize="seq-len")
    with pytest.raises(SettingsError, match="maximize must be 'seq-len' or None"):
        estimate("tiny-gpt2", batch_size=2, budget="4GiB", maximize="batch")
