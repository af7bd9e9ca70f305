"""The exact solver against a brute force over every layout of small chains, on the same cost model."""

import itertools
import random

import pytest

from memplan.planner.costs import ChainCosts, model_peak_bytes
from memplan.planner.solvers import dp, greedy
from memplan.planner.solvers.baselines import all_blocks, every_kth_block, sqrt_n_segments


def _random_chain(count: int, seed: int) -> ChainCosts:
    rng = random.Random(seed)
    saved = [rng.randint(50, 200) for _ in range(count)]  # bytes each block saves for the backward
    boundary = [rng.randint(5, 30) for _ in range(count)]  # its output, which the next block reads
    freed = tuple(tuple(sum(saved[a : b + 1]) + sum(boundary[a:b]) for b in range(a, count)) for a in range(count))
    growth = tuple(
        tuple(freed[a][b - a] + boundary[b] + rng.randint(0, 40) for b in range(a, count)) for a in range(count)
    )
    static = 1000
    kept = [static + sum(saved[:k]) + sum(boundary[:k]) for k in range(count + 1)]
    return ChainCosts(
        names=tuple(f"blocks.{j}" for j in range(count)),
        forward_flops=tuple(rng.choice([10, 20, 30]) for _ in range(count)),
        chainable=tuple(rng.random() < 0.8 for _ in range(count - 1)),
        forward_level_peak=tuple(kept[k] + rng.randint(0, 60) for k in range(count + 1)),
        backward_level_peak=tuple(kept[k] + rng.randint(20, 120) for k in range(count + 1)),
        backward_start_bytes=tuple(kept[j + 1] + rng.randint(0, 40) for j in range(count)),
        freed=freed,
        forward_growth=growth,
        step_flops=1000,
    )


def _all_layouts(costs: ChainCosts):
    """Every way to cover a chain with untouched blocks and checkpointed segments of joinable blocks."""
    count = len(costs)

    def from_position(a):
        if a == count:
            yield []
            return
        for rest in from_position(a + 1):
            yield rest  # block a untouched
        for b in range(a, count):
            if b > a and not costs.can_join(b - 1, b):
                break
            for rest in from_position(b + 1):
                yield [(a, b), *rest]

    yield from from_position(0)


@pytest.mark.parametrize("seed", range(12))
def test_dp_finds_the_least_recompute_layout_a_brute_force_finds(seed):
    costs = _random_chain(count=6, seed=seed)
    layouts = list(_all_layouts(costs))
    peaks = sorted(model_peak_bytes(costs, layout) for layout in layouts)
    for budget in (peaks[0], peaks[len(peaks) // 4], peaks[len(peaks) // 2], peaks[-1]):
        feasible = [layout for layout in layouts if model_peak_bytes(costs, layout) <= budget]
        best = min(costs.recompute_flops(layout) for layout in feasible)
        solution = dp.solve(costs, budget)
        assert solution is not None
        assert solution.recompute_flops == best
        assert solution.model_peak_bytes == model_peak_bytes(costs, list(solution.segments)) <= budget
    assert dp.solve(costs, peaks[0] - 1) is None  # below every layout's peak nothing fits


@pytest.mark.parametrize("seed", range(6))
def test_greedy_fits_when_it_answers_and_never_beats_the_dp(seed):
    costs = _random_chain(count=8, seed=100 + seed)
    none_peak = model_peak_bytes(costs, [])
    for budget in (none_peak, int(none_peak * 0.85), int(none_peak * 0.7)):
        exact = dp.solve(costs, budget)
        heuristic = greedy.solve(costs, budget)
        if heuristic is not None:
            assert heuristic.model_peak_bytes <= budget
            assert exact is not None and heuristic.recompute_flops >= exact.recompute_flops


def test_baselines_cover_the_chain_as_their_papers_say():
    costs = _random_chain(count=9, seed=7)
    assert all_blocks(costs) == [(j, j) for j in range(9)]
    assert every_kth_block(costs) == [(0, 0), (2, 2), (4, 4), (6, 6), (8, 8)]
    segments = sqrt_n_segments(costs)
    covered = [j for a, b in segments for j in range(a, b + 1)]
    assert covered == list(range(9))
    assert all(b - a + 1 <= 3 for a, b in segments)  # √9 = 3 blocks at most per segment
    assert all(costs.can_join(a, b) for a, b in segments)


def test_the_brute_force_enumerates_every_layout():
    costs = _random_chain(count=3, seed=1)
    costs = ChainCosts(**{**costs.__dict__, "chainable": (True, True)})
    # 3 joinable blocks: each layout is a composition of the chain into parts, each part either
    # untouched blocks or one checkpoint: 13 layouts (hand-counted).
    layouts = {tuple(layout) for layout in _all_layouts(costs)}
    assert len(layouts) == 13
    assert set(itertools.chain.from_iterable(layouts)) <= {(a, b) for a in range(3) for b in range(a, 3)}
