"""DDP with torch's ZeroRedundancyOptimizer the way users set ZeRO-1 up, for
tests/test_distributed_zero.py, and its real step measured by torch's CPU allocator: torch's fake
process group as the default group of N ranks (its collectives move nothing; the memory is DDP's and
the optimizer's own), tests/ddp_models.py's Stack (BatchNorm buffers that DDP broadcasts), AdamW or
SGD with momentum, and the allocator's own allocation and free events from torch's profiler, from
before the model is built. Nothing of memplan's is used.

DDP's built-in allreduce hook cannot take the fake group's all-reduce future, which carries no
value; the hook here does to memory what the built-in does with NCCL (`allreduce_hook` in
torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py): the bucket divided by the world
size in place, all-reduced in place, handed back."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.ddp_models import Stack, mean_square, rows
from tests.hand_measure import checkpoint_each, profiled_third_iteration_peak, training_iteration


def _allreduce_in_place(process_group, bucket):  # DDP checks a hook's annotations: none here
    tensor = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(tensor)
    future = torch.futures.Future()
    future.set_result(tensor)
    return future


def measured_peak(
    world_size: int, batch_size: int, optimizer: str = "adamw", checkpoint: bool = False, grad_accum: int = 1
) -> int:
    """Rank 0's peak bytes in the third iteration of the real step (two warm up; DDP makes its
    buckets again at the second)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return profiled_third_iteration_peak(lambda: _iteration(batch_size, optimizer, checkpoint, grad_accum))
    finally:
        dist.destroy_process_group()


def _iteration(batch_size: int, optimizer: str, checkpoint: bool, grad_accum: int) -> Callable[[], None]:
    """Builds the model, DDP and the optimizer; returns one iteration."""
    torch.manual_seed(0)
    model = Stack()
    if checkpoint:
        checkpoint_each(model.blocks)
    wrapped = nn.parallel.DistributedDataParallel(model)
    wrapped.register_comm_hook(None, _allreduce_in_place)
    if optimizer == "adamw":
        step = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        step = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=1e-2, momentum=0.9)
    return training_iteration(wrapped, rows(batch_size), mean_square, step, grad_accum)


def wide() -> nn.Module:
    """Two weights of 100,000 elements or more (262,144 and 131,072), which paged-adam8bit pages."""
    return nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1))


def wide_rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 1024)
