"""A fast heuristic for large candidate sets: checkpoint the best bytes-per-FLOP block until it fits.

Each round adds the single block whose checkpoint lowers the modelled peak most per recomputed
FLOP (one that leaves the peak where it is counts too, as a step towards a join: a block may save
nothing itself and still hand its neighbour an output that only a checkpoint over both frees);
when no block is left that does not raise the peak, it joins the two adjacent checkpoints whose
segment lowers it most (no extra FLOPs). A final pass drops checkpoints, costliest first, that
the budget does not need.
"""

from __future__ import annotations

from memplan.planner.costs import ChainCosts, model_peak_bytes
from memplan.planner.solvers import Solution, solution_for


def _joined(segments: list[tuple[int, int]], index: int) -> list[tuple[int, int]]:
    (a, _), (_, d) = segments[index], segments[index + 1]
    return segments[:index] + [(a, d)] + segments[index + 2 :]


def solve(costs: ChainCosts, budget_bytes: int) -> Solution | None:
    segments: list[tuple[int, int]] = []
    peak = model_peak_bytes(costs, segments)
    while peak > budget_bytes:
        taken = {j for a, b in segments for j in range(a, b + 1)}
        best: tuple[float, list[tuple[int, int]], int] | None = None
        for j in range(len(costs)):
            if j in taken:
                continue
            trial = sorted([*segments, (j, j)])
            trial_peak = model_peak_bytes(costs, trial)
            gain = (peak - trial_peak) / max(costs.segment_flops(j, j), 1)
            if trial_peak <= peak and (best is None or gain > best[0]):
                best = (gain, trial, trial_peak)
        if best is None:
            for index in range(len(segments) - 1):
                (_, b), (c, _) = segments[index], segments[index + 1]
                if c == b + 1 and costs.can_join(b, c):
                    trial = _joined(segments, index)
                    trial_peak = model_peak_bytes(costs, trial)
                    if trial_peak < peak and (best is None or peak - trial_peak > best[0]):
                        best = (peak - trial_peak, trial, trial_peak)
        if best is None:
            return None
        _, segments, peak = best
    for segment in sorted(segments, key=lambda s: -costs.recompute_flops([s])):
        trial = [s for s in segments if s != segment]
        if model_peak_bytes(costs, trial) <= budget_bytes:
            segments = trial
    return solution_for(costs, segments)
