"""The checkpointing people use today, as segments over the candidate chain."""

from __future__ import annotations

import math

from memplan.planner.costs import ChainCosts


def no_checkpointing(costs: ChainCosts) -> list[tuple[int, int]]:
    return []


def all_blocks(costs: ChainCosts) -> list[tuple[int, int]]:
    """Every block on its own, as Hugging Face's gradient_checkpointing_enable() does."""
    return [(j, j) for j in range(len(costs))]


def sqrt_n_segments(costs: ChainCosts) -> list[tuple[int, int]]:
    """Chen et al. 2016 (arXiv:1604.06174): about √n segments of √n blocks, one checkpoint each."""
    size = max(1, round(math.sqrt(len(costs))))
    segments: list[tuple[int, int]] = []
    start = 0
    for j in range(len(costs)):
        end_here = j == len(costs) - 1 or j - start + 1 == size or not costs.can_join(j, j + 1)
        if end_here:
            segments.append((start, j))
            start = j + 1
    return segments


def every_kth_block(costs: ChainCosts, k: int = 2) -> list[tuple[int, int]]:
    return [(j, j) for j in range(0, len(costs), k)]


BASELINES = {
    "none": no_checkpointing,
    "all blocks": all_blocks,
    "sqrt(n) segments": sqrt_n_segments,
    "every 2nd block": every_kth_block,
}
