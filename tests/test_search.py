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
