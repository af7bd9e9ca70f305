"""The largest batch size whose peak fits a budget, with as few traces as possible.

Peak memory is piecewise linear in the batch size, phase by phase (design.md §3): the backward
peak grows with the batch, the optimizer peak does not. Each phase's peak is fitted as a line
through the two traced batch sizes nearest the answer; a guess is confirmed by a trace, and the
search stops once a trace fits and the (just confirmed) lines put the next batch size over budget.
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.choices import MAX_COUNT

MAX_BATCH_SIZE = MAX_COUNT  # the largest batch size memplan models
# A fitted line is trusted when it predicted a confirming trace within this fraction of the budget.
FIT_TOLERANCE = 1e-3

PhasePeaks = dict[str, int]


def _line_max_batch(points: list[tuple[int, PhasePeaks]], budget_bytes: int) -> tuple[int, Callable[[int], float]]:
    """Fit every phase through two points; return the largest fitting batch and the predictor."""
    (b0, p0), (b1, p1) = points
    lines = {}
    for phase in p0:
        slope = (p1[phase] - p0[phase]) / (b1 - b0)
        lines[phase] = (p0[phase] - slope * b0, slope)

    def predict(batch: int) -> float:
        return max(intercept + slope * batch for intercept, slope in lines.values())

    best = MAX_BATCH_SIZE
    for intercept, slope in lines.values():
        if slope > 0:
            best = min(best, int((budget_bytes - intercept) // slope))
        elif intercept > budget_bytes:
            best = 0
    return max(best, 0), predict


def find_max_batch_size(known: dict[int, PhasePeaks], trace_at: Callable[[int], PhasePeaks], budget_bytes: int) -> int:
    """`known` holds at least two traced batch sizes and gains every batch size traced here."""

    def peak(batch: int) -> int:
        return max(known[batch].values())

    low = 0
    for attempt in range(64):
        low = max((b for b in known if peak(b) <= budget_bytes), default=0)
        high = min((b for b in known if peak(b) > budget_bytes and b > low), default=None)
        if high == low + 1:
            return low
        if low and high is not None:
            pair = [low, high]  # the chord across the bracket
        else:
            anchor = low or high or 1
            pair = sorted(sorted(known, key=lambda b: (abs(b - anchor), b))[:2])
        guess, predict = _line_max_batch([(b, known[b]) for b in pair], budget_bytes)
        if guess >= MAX_BATCH_SIZE and high is None:
            # No phase grew between the two: a cuda step's device figure can fall by a segment from one batch
            # size to the next (llama-3.2-1b, amp-bf16, expandable segments: 2 MiB less at batch 2 than at 1).
            # That says nothing of where the budget is reached: gallop up from the largest batch seen.
            guess = min(2 * max(known), MAX_BATCH_SIZE)
        guess = min(max(guess, low + 1), high - 1 if high is not None else MAX_BATCH_SIZE)
        if high is not None and attempt % 2 == 1:
            guess = (low + high) // 2  # every other step bisects, so a bent line cannot stall the search
        known[guess] = trace_at(guess)
        confirmed = abs(peak(guess) - predict(guess)) <= FIT_TOLERANCE * budget_bytes
        if peak(guess) <= budget_bytes and confirmed and predict(guess + 1) > budget_bytes:
            return guess
    return low


def last_fitting_from(found: int, fits: Callable[[int], bool], limit: int = MAX_BATCH_SIZE) -> int:
    """From `found`, a batch size that fits, the last one before the first that does not.

    The reserved peak on a cuda target is a step function of the batch size (allocator segments),
    flat for long stretches when a sample is small next to a segment, so a fitted line can stop
    far below where the budget is really reached. Galloping up (found+1, +2, +4, ...) until a
    size does not fit, then bisecting back, costs about 2·log2(distance) traces where stepping one
    at a time cost the distance. The answer is the edge of the first over-budget step above
    `found` (memory is not strictly monotonic in the batch size, so a larger size past that edge
    could fit again; memplan does not promise the global largest).
    """
    if not found:
        return found
    low, step, high = found, 1, None
    while high is None:
        probe = min(low + step, limit)
        if probe == low:
            return low  # the limit fits: the caller reports "at least" it
        if fits(probe):
            low, step = probe, step * 2
        else:
            high = probe
    return _bisect(low, high, fits)


def largest_fitting(start: int, fits: Callable[[int], bool], limit: int) -> int:
    """The largest size from 1 to `limit` that fits, searched from `start` (1 <= start <= limit);
    0 when not even 1 fits.

    For sizes whose memory is no line (a sequence length: attention grows with its square), so no
    fitted line guides the search: from a `start` that fits, double until a size does not (or the
    limit fits), from one that does not, take 0 as the floor; then bisect. About
    log2(answer / start) + log2(the bracket) questions. Like the batch search it finds the edge of
    the first step over the budget, not a larger size that might fit again past it.
    """
    if fits(start):
        low, high = start, None
        while high is None:
            if low == limit:
                return low
            probe = min(2 * low, limit)
            if fits(probe):
                low = probe
            else:
                high = probe
    else:
        low, high = 0, start
    return _bisect(low, high, fits)


def _bisect(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The last size that fits between `low` (fits, or 0) and `high` (does not)."""
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low
