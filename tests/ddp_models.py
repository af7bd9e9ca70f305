"""A model trained with DistributedDataParallel the way users set it up, for
tests/test_distributed_ddp.py: torch's gloo process group in this process (world size 1, every
DDP default), with torch's own `allreduce_hook` as its comm hook only to read the gradient buckets
it is handed. Nothing of memplan's is used."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

WIDTH, HIDDEN, BLOCKS = 64, 256, 3
BUCKETS: dict[int, torch.Tensor] = {}  # the Reducer's buckets, by index, as the last backward saw them


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(WIDTH, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Stack(nn.Module):
    """BatchNorm's running statistics are buffers: DDP broadcasts them before every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack() -> nn.Module:
    return Stack()


class WithUnused(Stack):
    """A head the loss never reaches: DDP (without find_unused_parameters) refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.unused_head = nn.Linear(WIDTH, 1)


def with_unused() -> nn.Module:
    return WithUnused()


def _reading_buckets(process_group, bucket):
    BUCKETS[bucket.index()] = bucket.buffer()
    return allreduce_hook(process_group, bucket)


def ddp_stack(gradient_as_bucket_view: bool = False) -> nn.Module:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    BUCKETS.clear()
    model = nn.parallel.DistributedDataParallel(Stack(), gradient_as_bucket_view=gradient_as_bucket_view)
    model.register_comm_hook(None, _reading_buckets)
    return model


def ddp_stack_bucket_view() -> nn.Module:
    return ddp_stack(gradient_as_bucket_view=True)


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.square().mean()
