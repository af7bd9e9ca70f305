"""A model sharded with FSDP2 the way users set it up, for tests/test_distributed_fsdp.py, and its
real step measured by torch's CPU allocator: torch's fake process group as the default group (its
collectives move nothing; the memory is FSDP2's own), fully_shard on each block and then the root,
AdamW or SGD, and the allocator's own allocation and free events from torch's profiler, from before
the model is built (the process group and its DeviceMesh are made before, as a job makes them at
start-up). Nothing of memplan's is used."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tests.hand_measure import checkpoint_each, profiled_third_iteration_peak, training_iteration

WIDTH, HIDDEN, BLOCKS = 64, 256, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(WIDTH, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Stack(nn.Module):
    """An embedding-like first layer and a head the root owns, three blocks FSDP2 shards each."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 3)  # 3 rows: not divisible by the world size, so rank 0's shard is padded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack() -> nn.Module:
    return Stack()


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.square().mean()


def measured_peak(
    world_size: int,
    batch_size: int,
    reshard_after_forward: bool,
    checkpoint: bool = False,
    optimizer: str = "adamw",
    grad_accum: int = 1,
    shard_size: int | None = None,
) -> int:
    """Rank 0's peak bytes in the third iteration of the real step (two warm up). With `shard_size`,
    HSDP: the mesh is world_size / shard_size replicas by shard_size shards, as torch's docs build it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        if shard_size is None:
            mesh = init_device_mesh("cpu", (world_size,))
        else:
            mesh = init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("dp", "shard"))

        def build() -> Callable[[], None]:
            torch.manual_seed(0)
            model = Stack()
            if checkpoint:
                checkpoint_each(model.blocks)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
            if optimizer == "adamw":
                step = torch.optim.AdamW(model.parameters(), lr=1e-3)
            else:
                step = torch.optim.SGD(model.parameters(), lr=1e-3)
            return training_iteration(model, rows(batch_size), mean_square, step, grad_accum)

        return profiled_third_iteration_peak(build)
    finally:
        dist.destroy_process_group()
