"""The greedy planner beside the exact DP on random chains: how often it answers, and its extra recompute.

Usage (from the repository root):  python benchmarks/greedy_vs_dp.py [CHAINS]

The chains are tests/test_planner_solvers.py's random 8-block cost models (seeds 100 on), each at
budgets of 100, 85, 70 and 60% of its unchecked peak. Prints how many of the DP's answers the greedy
heuristic also answered, and the largest ratio of its recompute to the DP's least; the tests bound
the greedy with these figures (tests/test_planner_solvers.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan.planner.costs import model_peak_bytes  # noqa: E402
from memplan.planner.solvers import dp, greedy  # noqa: E402
from tests.test_planner_solvers import _random_chain  # noqa: E402


def main() -> None:
    chains = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    answered_by_dp = answered_by_both = 0
    worst_ratio = 1.0
    for seed in range(100, 100 + chains):
        costs = _random_chain(count=8, seed=seed)
        unchecked = model_peak_bytes(costs, [])
        for share in (1.0, 0.85, 0.7, 0.6):
            budget = int(unchecked * share)
            exact, heuristic = dp.solve(costs, budget), greedy.solve(costs, budget)
            if exact is None:
                continue
            answered_by_dp += 1
            if heuristic is not None:
                answered_by_both += 1
                worst_ratio = max(worst_ratio, heuristic.recompute_flops / max(exact.recompute_flops, 1))
    print(f"{chains} chains x 4 budgets: the DP answered {answered_by_dp}, the greedy {answered_by_both} of those")
    print(f"greedy recompute / DP recompute, worst: {worst_ratio:.2f}")


if __name__ == "__main__":
    main()
