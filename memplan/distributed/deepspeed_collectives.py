"""DeepSpeed's per-rank loops, made as cheap as one rank's tensors under a trace.

ZeRO-3 reduces each bucket of gradients with `reduce_scatter_coalesced`
(deepspeed/runtime/comm/coalesced_collectives.py): it slices every gradient into one view per rank of the job,
interleaves those views with padding into one flat buffer (`torch.cat`), and scatters it. A real run makes those
world-size × gradients views in microseconds; under fake tensors each is a dispatch through FakeTensorMode and
memplan's own modes, so a rank of 1,024 ranks took 30 s where one of 8 took 5 (tiny-gpt2), and its views were
as many events to simulate. The stand-in below makes the same allocations in the same order (the padding
tensors rank by rank, the flat buffer, the rank's narrowed outputs of that buffer) and the same collective call,
without the views: its figures are DeepSpeed's (tests/test_distributed_deepspeed_collectives.py compares the
two traces event by event, and the rank with the real run).

It stands in only for the function it was written from (its source's digest) and only over fake tensors: a
real run (memplan's CPU validator) runs DeepSpeed's own, and another DeepSpeed version keeps its own function,
slower but right.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

# sha256 of `inspect.getsource(reduce_scatter_coalesced)` in DeepSpeed 0.19.8, the version it was written from.
REDUCE_SCATTER_COALESCED_SHA256 = "89aab0f80f1a80b328a6b87b3cec95352b8973c4a69e3c805ac162950ff9f7fc"


def source_digest(function: Callable[..., Any]) -> str:
    """sha256 of a function's source (its decorators stripped off by `inspect.unwrap` first)."""
    return hashlib.sha256(inspect.getsource(inspect.unwrap(function)).encode()).hexdigest()


def padding_sizes(numel: int, world_size: int) -> list[tuple[int, int]]:
    """(rank, elements) of the padding DeepSpeed adds to a tensor of `numel` elements split in `world_size`
    chunks of ceil(numel / world_size): the short last chunk, and every rank past the tensor's end."""
    chunk = math.ceil(numel / world_size)
    sizes = []
    for rank in range(numel // chunk if chunk else 0, world_size):
        held = max(0, min(chunk, numel - rank * chunk))
        if chunk - held > 0:
            sizes.append((rank, chunk - held))
    return sizes


def reduce_scatter_coalesced_of(original: Callable[..., Any]) -> Callable[..., Any]:
    """`reduce_scatter_coalesced` for fake tensors, DeepSpeed's `original` for real ones."""
    from deepspeed import comm as dist
    from deepspeed.runtime.comm.coalesced_collectives import _torch_reduce_scatter_fn

    @torch.no_grad()
    def reduce_scatter_coalesced(tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
        if not tensors or not all(isinstance(tensor, FakeTensor) for tensor in tensors):
            return original(tensors, group)
        this_rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        chunks = [math.ceil(tensor.numel() / world_size) for tensor in tensors]
        row = sum(chunks)  # one rank's interleaved partitions, padded
        padding: list[torch.Tensor] = []  # held to the end, as DeepSpeed's list holds them
        if len(tensors) == 1 and tensors[0].numel() % world_size == 0:
            flat = tensors[0].view(-1)
        else:
            by_rank: dict[int, list[tuple[int, int]]] = {}
            for index, tensor in enumerate(tensors):
                for rank, elements in padding_sizes(tensor.numel(), world_size):
                    by_rank.setdefault(rank, []).append((index, elements))
            for rank in sorted(by_rank):  # DeepSpeed's order: rank by rank, each rank's tensors in order
                for index, elements in by_rank[rank]:
                    padding.append(torch.empty(elements, dtype=tensors[index].dtype, device=tensors[index].device))
            flat = torch.empty(world_size * row, dtype=tensors[0].dtype, device=tensors[0].device)
            grid = flat.view(world_size, row)
            offset = 0
            for tensor, chunk in zip(tensors, chunks, strict=True):
                if not chunk:  # an empty tensor: nothing of it in any rank's partition
                    continue
                whole_ranks = tensor.numel() // chunk
                source = tensor.reshape(-1)
                whole = source[: whole_ranks * chunk].view(whole_ranks, chunk)
                grid[:whole_ranks, offset : offset + chunk].copy_(whole)
                rest = tensor.numel() - whole_ranks * chunk
                if rest:
                    grid[whole_ranks, offset : offset + rest].copy_(source[whole_ranks * chunk :])
                offset += chunk
        flat.div_(world_size)  # pre-divide
        own = flat.narrow(0, this_rank * row, row)
        _torch_reduce_scatter_fn(flat, own, group=group)
        outputs = []
        offset = 0
        for tensor, chunk in zip(tensors, chunks, strict=True):
            held = max(0, min(chunk, tensor.numel() - this_rank * chunk))
            outputs.append(own.narrow(0, offset, held))
            offset += chunk
        return outputs  # the padding goes with this frame, as DeepSpeed's list goes with its

    return reduce_scatter_coalesced


@contextlib.contextmanager
def per_rank_loops_replaced() -> Iterator[None]:
    """ZeRO-3's reduce_scatter_coalesced (stage3.py imports it by name) replaced while the rank runs, where it is
    the function the stand-in was written from."""
    import deepspeed.runtime.zero.stage3 as stage3

    original = stage3.reduce_scatter_coalesced
    if getattr(original, "memplan_stand_in", False) or source_digest(original) != REDUCE_SCATTER_COALESCED_SHA256:
        yield
        return
    stand_in = reduce_scatter_coalesced_of(original)
    stand_in.memplan_stand_in = True  # type: ignore[attr-defined]
    stage3.reduce_scatter_coalesced = stand_in
    try:
        yield
    finally:
        stage3.reduce_scatter_coalesced = original
