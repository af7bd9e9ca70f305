"""Exact least-recompute checkpointing of a chain under a byte budget, by dynamic programming.

Walk the chain left to right. At a segment boundary a, the only thing the rest of the chain needs
from the choices so far is F, the bytes freed by the segments already closed (every level from a
on is lowered by F), and the cost so far. Keep the Pareto front of (recompute FLOPs, F): a choice
that costs more and frees less can never lead to a better plan. From each point either leave
block a alone or close one checkpoint over a..b, checking each level the choice settles against
the budget (the cost model of `memplan.planner.costs`, whose `model_peak_bytes` agrees).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.planner.costs import ChainCosts
from memplan.planner.solvers import Solution, solution_for


@dataclass(frozen=True)
class _Point:
    flops: int
    freed: int
    parent: _Point | None
    segment: tuple[int, int] | None


def _pareto(points: list[_Point]) -> list[_Point]:
    front: list[_Point] = []
    for point in sorted(points, key=lambda p: (p.flops, -p.freed)):
        if not front or point.freed > front[-1].freed:
            front.append(point)
    return front


def _segments(point: _Point) -> list[tuple[int, int]]:
    found = []
    node: _Point | None = point
    while node is not None:
        if node.segment is not None:
            found.append(node.segment)
        node = node.parent
    return found[::-1]


def solve(costs: ChainCosts, budget_bytes: int) -> Solution | None:
    count = len(costs)

    state = costs.checkpoint_state_bytes  # what a checkpoint holds from its forward's start to its backward's end

    def level_fits(level: int, freed: int, within: int = 0, holding: int = 0) -> bool:
        return (
            costs.forward_level_peak[level] - freed - within <= budget_bytes
            and costs.backward_level_peak[level] - freed + holding <= budget_bytes
        )

    fronts: list[list[_Point]] = [[] for _ in range(count + 1)]
    fronts[0] = [_Point(0, 0, None, None)]
    for a in range(count):
        fronts[a] = _pareto(fronts[a])
        for point in fronts[a]:
            if not level_fits(a, point.freed):
                continue
            fronts[a + 1].append(_Point(point.flops, point.freed, point, None))  # block a not checkpointed
            if state and not level_fits(a, point.freed, -state, state):
                continue  # a checkpoint starting at a: its state beside level a
            for b in range(a, count):
                if b > a and not (
                    costs.can_join(b - 1, b) and level_fits(b, point.freed, costs.freed_bytes(a, b - 1), state)
                ):
                    break  # a longer segment re-checks the same inner levels: it cannot fit either
                flops = point.flops + costs.segment_flops(a, b)
                recompute_peak = (
                    costs.recompute_base_bytes(b) - point.freed - costs.freed_bytes(a, b) + costs.growth_bytes(a, b)
                )
                if recompute_peak <= budget_bytes:
                    fronts[b + 1].append(_Point(flops, point.freed + costs.freed_bytes(a, b), point, (a, b)))
    finals = [point for point in _pareto(fronts[count]) if level_fits(count, point.freed)]
    if not finals:
        return None
    least = min(point.flops for point in finals)
    ties = [solution_for(costs, _segments(point)) for point in finals if point.flops == least]
    return min(ties, key=lambda solution: solution.model_peak_bytes)
