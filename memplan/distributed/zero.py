"""ZeRO stage 1, one rank (`--parallel zero1 --world-size N`): DDP with torch's ZeroRedundancyOptimizer.

ZeRO's first stage shards the optimizer state across the data-parallel ranks and nothing else: each
rank keeps the whole model and every gradient (DDP all-reduces them, buckets and all, as `--parallel
ddp`), and updates only its own share of the parameters, then broadcasts them to the others. torch's
own implementation (torch/distributed/optim/zero_redundancy_optimizer.py) runs here, on rank 0 of a
fake process group over fake tensors, around the optimizer the settings name:
- The share: ZeroRedundancyOptimizer hands out whole parameters, largest first, each to the rank
  with the fewest elements so far (`_partition_parameters`), so rank 0's share is near 1/N but
  rarely exactly it; the local optimizer is built over that share, so its state (Adam's moments)
  is that share's.
- The step: the local optimizer's step over the share, then each rank's parameters broadcast in
  place from their owner (`_sync_params`), which allocates nothing.
- zero_grad frees every gradient, as torch.optim's does.

ZeroRedundancyOptimizer asks the default process group for its rank and for the broadcasts' global
source ranks, so memplan makes a fake default group around its construction and each step
(memplan.distributed.fake_group) and points the optimizer at it each time.

DeepSpeed's ZeRO-1 shards the same state differently (its flattened fp32 partitions, exactly 1/N)
and adds buffers of its own (reduce and all-gather buckets): not modelled here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from memplan.distributed.fake_group import fake_default_group

OPTION = "--parallel zero1"


class ShardedOptimizerRank(ZeroRedundancyOptimizer):
    """Rank 0's ZeroRedundancyOptimizer of `world_size` ranks, each call that needs the default group
    made inside a fake one."""

    def __init__(
        self, params: Iterable[torch.nn.Parameter], optimizer_class: type[Optimizer], world_size: int, **defaults: Any
    ) -> None:
        with fake_default_group(world_size, OPTION):
            super().__init__(list(params), optimizer_class=optimizer_class, **defaults)

    @property
    def local_optimizer(self) -> Optimizer:
        """The optimizer over this rank's share of the parameters, which holds the state."""
        return self.optim

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        import torch.distributed as dist

        with fake_default_group(self.world_size, OPTION):
            self.process_group = dist.group.WORLD  # this step's group: the one it was built with is gone
            return super().step(closure, **kwargs)
