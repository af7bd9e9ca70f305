"""The largest batch size whose peak fits a budget, with as few traces as possible.

Peak memory is piecewise linear in the batch size, phase by phase (design.md §3): the backward
peak grows with the batch, the optimizer peak does not. Each phase's peak is fitted as a line
through the two traced batch sizes nearest the answer; a guess is confirmed by a trace, and the
search stops once a trace fits and the (just confirmed) lines put the next batch size over budget.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_BATCH_SIZE = 1 << 20
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
        guess = min(max(guess, low + 1), high - 1 if high is not None else MAX_BATCH_SIZE)
        if high is not None and attempt % 2 == 1:
            guess = (low + high) // 2  # every other step bisects, so a bent line cannot stall the search
        known[guess] = trace_at(guess)
        confirmed = abs(peak(guess) - predict(guess)) <= FIT_TOLERANCE * budget_bytes
        if peak(guess) <= budget_bytes and confirmed and predict(guess + 1) > budget_bytes:
            return guess
    return low
