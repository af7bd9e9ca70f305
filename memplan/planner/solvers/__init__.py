"""Checkpointing strategies over a chain of candidates; each returns a `Solution` or None.

One file per strategy, same signature (Checkmate's layout, design.md §5): the exact dynamic
program (`dp`), a fast greedy heuristic (`greedy`), and the baselines people use.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.planner.costs import ChainCosts, model_peak_bytes


@dataclass(frozen=True)
class Solution:
    segments: tuple[tuple[int, int], ...]  # (first, last) candidate indices, in order
    model_peak_bytes: int  # what the cost model predicts; the planner re-traces to confirm
    recompute_flops: int


def solution_for(costs: ChainCosts, segments: list[tuple[int, int]]) -> Solution:
    ordered = sorted(segments)
    return Solution(tuple(ordered), model_peak_bytes(costs, ordered), costs.recompute_flops(ordered))
