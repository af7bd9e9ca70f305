"""The exact solver against a brute force over every layout of small chains, on the same cost model."""

import itertools
import random

import pytest

from memplan.planner.costs import ChainCosts, model_peak_bytes
from memplan.planner.solvers import dp, greedy
from memplan.planner.solvers.baselines import all_blocks, every_kth_block, sqrt_n_segments


def _random_chain(count: int, seed: int, state: int = 0) -> ChainCosts:
    """`state`: what each checkpoint holds besides its saved tensors (the cpu target's copy of the RNG state)."""
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
        checkpoint_state_bytes=state,
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


@pytest.mark.parametrize("state", [0, 40, 150])
@pytest.mark.parametrize("seed", range(12))
def test_dp_finds_the_least_recompute_layout_a_brute_force_finds(seed, state):
    costs = _random_chain(count=6, seed=seed, state=state)
    layouts = list(_all_layouts(costs))
    peaks = sorted(model_peak_bytes(costs, layout) for layout in layouts)
    for budget in sorted(set(peaks)):  # every budget at which the answer can change
        feasible = [layout for layout in layouts if model_peak_bytes(costs, layout) <= budget]
        best = min(costs.recompute_flops(layout) for layout in feasible)
        solution = dp.solve(costs, budget)
        assert solution is not None
        assert solution.recompute_flops == best
        assert solution.model_peak_bytes == model_peak_bytes(costs, list(solution.segments)) <= budget
    assert dp.solve(costs, peaks[0] - 1) is None  # below every layout's peak nothing fits


@pytest.mark.parametrize("seed", range(6))
def test_greedy_answers_where_the_dp_does_fits_and_stays_near_it(seed):
    """On these chains the DP answers at every budget below; so must the greedy heuristic, within a
    bound on its extra recompute (`python benchmarks/greedy_vs_dp.py`: over 200 such chains it answered
    706 of the DP's 707 answers, with at most 1.5x its recompute)."""
    costs = _random_chain(count=8, seed=100 + seed)
    none_peak = model_peak_bytes(costs, [])
    for budget in (none_peak, int(none_peak * 0.85), int(none_peak * 0.7)):
        exact = dp.solve(costs, budget)
        heuristic = greedy.solve(costs, budget)
        assert exact is not None and heuristic is not None
        assert heuristic.model_peak_bytes == model_peak_bytes(costs, list(heuristic.segments)) <= budget
        assert exact.recompute_flops <= heuristic.recompute_flops <= 1.5 * exact.recompute_flops
        if budget == none_peak:
            assert heuristic.segments == ()  # nothing to checkpoint: the final pass drops everything


def test_baselines_cover_the_chain_as_their_papers_say():
    costs = _random_chain(count=9, seed=7)
    assert all_blocks(costs) == [(j, j) for j in range(9)]
    assert every_kth_block(costs) == [(0, 0), (2, 2), (4, 4), (6, 6), (8, 8)]
    segments = sqrt_n_segments(costs)
    covered = [j for a, b in segments for j in range(a, b + 1)]
    assert covered == list(range(9))
    assert all(b - a + 1 <= 3 for a, b in segments)  # √9 = 3 blocks at most per segment
    assert all(costs.can_join(a, b) for a, b in segments)


def test_sqrt_n_segments_are_exact_where_the_chain_allows_and_break_where_it_does_not():
    """Chen et al.: n blocks in segments of round(√n); a segment also ends where two neighbours may
    not share a checkpoint. Layouts written out by hand."""
    from dataclasses import replace

    costs = _random_chain(count=9, seed=7)
    all_joinable = replace(costs, chainable=(True,) * 8)
    assert sqrt_n_segments(all_joinable) == [(0, 2), (3, 5), (6, 8)]
    broken = replace(costs, chainable=(True, True, True, True, False, True, True, True))  # 4 | 5
    assert sqrt_n_segments(broken) == [(0, 2), (3, 4), (5, 7), (8, 8)]
    assert sqrt_n_segments(replace(costs, chainable=(False,) * 8)) == [(j, j) for j in range(9)]
    two = replace(_random_chain(count=2, seed=3), chainable=(True,))
    assert sqrt_n_segments(two) == [(0, 0), (1, 1)]  # round(√2) = 1 block per segment
    assert sqrt_n_segments(replace(_random_chain(count=12, seed=3), chainable=(True,) * 11)) == [
        (0, 2),
        (3, 5),
        (6, 8),
        (9, 11),
    ]  # round(√12) = 3


def test_the_brute_force_enumerates_every_layout():
    costs = _random_chain(count=3, seed=1)
    costs = ChainCosts(**{**costs.__dict__, "chainable": (True, True)})
    # 3 joinable blocks: each layout is a composition of the chain into parts, each part either
    # untouched blocks or one checkpoint: 13 layouts (hand-counted).
    layouts = {tuple(layout) for layout in _all_layouts(costs)}
    assert len(layouts) == 13
    assert set(itertools.chain.from_iterable(layouts)) <= {(a, b) for a in range(3) for b in range(a, 3)}


def test_greedy_joins_checkpoints_when_single_blocks_cannot_reach_the_budget():
    """Budgets below the peak of checkpointing every block on its own are reachable only by joining
    neighbours into segments; the greedy heuristic must get there (its second phase) and stay near
    the DP. Truth: a brute force over every layout for the tightest budgets."""
    joined_answers = cases = 0
    for seed in range(40):
        costs = _random_chain(count=6, seed=seed)
        peaks = sorted(model_peak_bytes(costs, layout) for layout in _all_layouts(costs))
        singles = model_peak_bytes(costs, [(j, j) for j in range(len(costs))])
        for budget in (peaks[0], peaks[len(peaks) // 8], peaks[len(peaks) // 4]):
            if budget >= singles:
                continue
            cases += 1
            exact, heuristic = dp.solve(costs, budget), greedy.solve(costs, budget)
            assert exact is not None and heuristic is not None
            assert model_peak_bytes(costs, list(heuristic.segments)) <= budget
            assert heuristic.recompute_flops <= 1.5 * exact.recompute_flops
            joined_answers += any(first != last for first, last in heuristic.segments)
    assert cases >= 20 and joined_answers >= cases // 2


def _additive_chain(
    head_peak: int, saved: list[int], flops: list[int], boundary: list[int] | None = None, chainable=None
) -> ChainCosts:
    """A chain whose peak is at the head and falls by exactly what each checkpoint frees, so the
    greedy rule can be followed by hand: checkpointing segment a..b frees saved[a..b] plus the
    outputs a..b-1 that only the segment's own next block reads (boundary). Nothing else peaks:
    the other levels and every recompute spike stay at or below zero."""
    count = len(saved)
    boundary = boundary if boundary is not None else [0] * count
    return ChainCosts(
        names=tuple(f"blocks.{j}" for j in range(count)),
        forward_flops=tuple(flops),
        chainable=tuple(chainable) if chainable is not None else (True,) * (count - 1),
        forward_level_peak=(0,) * (count + 1),
        backward_level_peak=(0,) * count + (head_peak,),
        backward_start_bytes=(0,) * count,
        freed=tuple(tuple(sum(saved[a : b + 1]) + sum(boundary[a:b]) for b in range(a, count)) for a in range(count)),
        forward_growth=tuple((0,) * (count - a) for a in range(count)),
        step_flops=sum(flops),
    )


def test_greedy_takes_the_most_bytes_per_flop_not_the_most_bytes_nor_the_cheapest():
    """Block 0 frees 300 B for 30 FLOPs (10 B/FLOP), block 1 frees 100 B for 20 (5 B/FLOP); 100 B
    must go. The rule takes block 0 and stops: 900 B fits, and dropping it would not. (The DP takes
    the cheaper block 1; the heuristic is greedy by its ratio, which is what this pins.)"""
    costs = _additive_chain(1000, saved=[300, 100], flops=[30, 20])
    answer = greedy.solve(costs, 900)
    assert answer is not None and answer.segments == ((0, 0),)
    assert (answer.model_peak_bytes, answer.recompute_flops) == (700, 30)
    assert dp.solve(costs, 900).segments == ((1, 1),)


def test_greedy_counts_a_block_that_recomputes_nothing_as_one_flop():
    """A block of 1 FLOP freeing 10 B (10 B/FLOP) beats one of 2 FLOPs freeing 15 B (7.5 B/FLOP);
    the FLOP count is floored at 1 only so that a block computing nothing does not divide by zero."""
    costs = _additive_chain(1000, saved=[10, 15], flops=[1, 2])
    assert greedy.solve(costs, 995).segments == ((0, 0),)
    free_block = _additive_chain(1000, saved=[10, 15], flops=[0, 2])  # 10 B/FLOP against 7.5
    assert greedy.solve(free_block, 995).segments == ((0, 0),)


def test_greedy_breaks_ties_towards_the_earlier_block():
    costs = _additive_chain(1000, saved=[10, 10, 10], flops=[10, 10, 10])
    assert greedy.solve(costs, 990).segments == ((0, 0),)
    assert greedy.solve(costs, 980).segments == ((0, 0), (1, 1))


def test_greedy_joins_neighbours_only_where_the_chain_allows_and_at_the_right_place():
    """Every block checkpointed on its own frees 30 B of 1000; the budget needs the 50 B output
    that block 1 hands block 2, freed only by one checkpoint over both. Block 0 may not join
    block 1. By hand: blocks 0, 1, 2 are taken one by one (910 B), then 1 and 2 joined (860 B),
    and the final pass finds that neither checkpoint can go (970 B, 890 B)."""
    costs = _additive_chain(1000, saved=[30, 30, 30], flops=[10, 10, 10], boundary=[50, 50, 0], chainable=[False, True])
    answer = greedy.solve(costs, 880)
    assert answer is not None and answer.segments == ((0, 0), (1, 2))
    assert answer.model_peak_bytes == 1000 - 30 - (30 + 30 + 50)
    no_joins = _additive_chain(
        1000, saved=[30, 30, 30], flops=[10, 10, 10], boundary=[50, 50, 0], chainable=[False, False]
    )
    assert greedy.solve(no_joins, 880) is None  # 910 B is the least any layout reaches
    two = _additive_chain(1000, saved=[30, 30], flops=[10, 10], boundary=[50, 0])
    assert greedy.solve(two, 900).segments == ((0, 1),)


def test_greedy_joins_the_pair_that_frees_most_and_the_earlier_of_equals():
    equal = _additive_chain(1000, saved=[30, 30, 30], flops=[10, 10, 10], boundary=[50, 50, 0])
    assert greedy.solve(equal, 880).segments == ((0, 1), (2, 2))
    later_frees_more = _additive_chain(1000, saved=[30, 30, 30], flops=[10, 10, 10], boundary=[50, 60, 0])
    assert greedy.solve(later_frees_more, 860).segments == ((0, 0), (1, 2))  # 850 B; without block 0, 880


def test_greedys_final_pass_drops_the_costliest_checkpoint_the_budget_does_not_need():
    """By hand (head peak 1000 B, budget 880 B): taken in ratio order C (20 B/1 FLOP), Y (20 B/2),
    then D (100 B/50) reaches 860 B. The final pass tries the costliest first: without D 960 B,
    kept; without Y exactly 880 B, which fits, so Y goes; without C then 900 B, kept. Trying the
    cheapest first would drop C instead (52 FLOPs, not 51)."""
    costs = _additive_chain(1000, saved=[20, 20, 100, 5], flops=[1, 2, 50, 5])
    answer = greedy.solve(costs, 880)
    assert answer is not None and answer.segments == ((0, 0), (2, 2))
    assert (answer.model_peak_bytes, answer.recompute_flops) == (880, 51)


def test_greedy_steps_through_checkpoints_that_free_nothing_to_the_join_that_does():
    """Two blocks that save nothing themselves, one handing the other a 50 B output: only one
    checkpoint over both frees it (the DP's answer). Neither single checkpoint lowers the peak,
    so a rule that took only those would give up; the greedy heuristic takes both and joins them."""
    costs = _additive_chain(1000, saved=[0, 0], flops=[10, 10], boundary=[50, 0])
    assert dp.solve(costs, 950).segments == ((0, 1),)
    assert greedy.solve(costs, 950).segments == ((0, 1),)
    assert greedy.solve(costs, 949) is None


def test_a_checkpoint_s_state_beside_its_first_block_can_be_what_does_not_fit():
    """Worked by hand: block 0's checkpoint frees 300 B of saved tensors but holds a 50 B state (the cpu target's copy
    of the generator's state) from its forward's start, beside block 0's own forward peak (980 + 50 > 1,000). Level 1's
    backward needs what it frees (1,200 - 250 <= 1,000), so no layout fits; a solver that checked the state only
    inside the segment and in its recomputation took the checkpoint as fitting."""
    costs = ChainCosts(
        names=("blocks.0", "blocks.1"),
        forward_flops=(10, 10),
        chainable=(False,),
        forward_level_peak=(980, 500, 500),
        backward_level_peak=(900, 1200, 500),
        backward_start_bytes=(800, 800),
        freed=((300, 320), (10,)),
        forward_growth=((310, 330), (20,)),
        step_flops=100,
        checkpoint_state_bytes=50,
    )
    assert model_peak_bytes(costs, [(0, 0)]) == 980 + 50
    assert model_peak_bytes(costs, []) == 1200
    assert dp.solve(costs, 1000) is None
    assert dp.solve(costs, 1030).segments == ((0, 0),)
