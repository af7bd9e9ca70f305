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

ZeRO-3 gathers a module's parameters in one flat buffer per dtype and then, in `AllGatherCoalescedHandle.wait`
(runtime/zero/partition_parameters.py), concatenates each parameter from one narrowed view per rank: the stand-in
makes each parameter's buffer and copies into it from a two-dimensional view of the flat one, the same
allocation without the views. (The handle's list of one view per rank is made in a closure DeepSpeed builds per
parameter, which stays DeepSpeed's.)

Each stands in only for the function it was written from (its source's digest) and only over fake tensors: a
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

# sha256 of each function's source (inspect.getsource) in DeepSpeed 0.19.8, the version the stand-ins were written
# from: coalesced_collectives.reduce_scatter_coalesced and partition_parameters.AllGatherCoalescedHandle.wait.
REDUCE_SCATTER_COALESCED_SHA256 = "d05c7b944514f710d32f74ef474522992b1dc9d334de78e511af810b5e4e6cc5"
COALESCED_WAIT_SHA256 = "66e20af5df511a69fb0d9a53dc67213e0416f40d9b077c4b5ffaf163892fee53"


def source_digest(function: Callable[..., Any]) -> str:
    """sha256 of a function's own source, under its decorators: those of functools.wraps (`__wrapped__`) and
    DeepSpeed's `instrument_w_nvtx`, whose `wrapped_fn` keeps the function only in its closure (as `func`)."""
    while True:
        function = inspect.unwrap(function)
        inner = inspect.getclosurevars(function).nonlocals.get("func") if function.__name__ == "wrapped_fn" else None
        if not callable(inner):
            break
        function = inner
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


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
                source = tensor.view(-1)  # as DeepSpeed flattens it: a view, never a copy
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


def coalesced_wait_of(original: Callable[..., Any]) -> Callable[..., Any]:
    """`AllGatherCoalescedHandle.wait` for a fake, unquantized gather on a synchronized device (the CPU
    accelerator memplan gives DeepSpeed), DeepSpeed's `original` otherwise."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    def wait(self: Any, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        partitions = self.partitions
        if (
            self.quantization
            or self.use_secondary_tensor
            or not partitions
            or not isinstance(partitions[0], FakeTensor)
            or not get_accelerator().is_synchronized_device()
            or any(param.ds_tensor.ds_numel == 0 for param in self.params)
        ):
            return original(self, handle_dependency)
        self.allgather_handle.wait()
        first = partitions[0]
        row = first.numel()  # one rank's partition of every parameter in the gather
        grid = first.as_strided((self.world_size, row), (row, 1), first.storage_offset())
        offset = 0
        for param in self.params:
            assert param.ds_status == ZeroParamStatus.INFLIGHT, f"expected param {param.ds_summary()} to be inflight"
            shard = param.ds_tensor.ds_numel
            gathered = torch.empty(param.ds_numel, dtype=first.dtype, device=first.device)  # torch.cat's output
            whole_ranks = min(param.ds_numel // shard, self.world_size)
            if whole_ranks:
                whole = grid[:whole_ranks, offset : offset + shard]
                gathered[: whole_ranks * shard].view(whole_ranks, shard).copy_(whole)
            rest = param.ds_numel - whole_ranks * shard
            if rest:
                gathered[whole_ranks * shard :].copy_(grid[whole_ranks, offset : offset + rest])
            param.data = gathered.view(param.ds_shape).to(param.ds_tensor.dtype)
            param.ds_status = ZeroParamStatus.AVAILABLE
            offset += shard
        self.complete = True

    return wait


@contextlib.contextmanager
def per_rank_loops_replaced() -> Iterator[None]:
    """ZeRO-3's reduce_scatter_coalesced (stage3.py imports it by name) and AllGatherCoalescedHandle.wait replaced
    while the rank runs, each where it is the function its stand-in was written from."""
    import deepspeed.runtime.zero.partition_parameters as partition_parameters
    import deepspeed.runtime.zero.stage3 as stage3

    handle = partition_parameters.AllGatherCoalescedHandle
    with contextlib.ExitStack() as replaced:
        for owner, name, digest, stand_in_of in (
            (stage3, "reduce_scatter_coalesced", REDUCE_SCATTER_COALESCED_SHA256, reduce_scatter_coalesced_of),
            (handle, "wait", COALESCED_WAIT_SHA256, coalesced_wait_of),
        ):
            original = getattr(owner, name)
            if getattr(original, "memplan_stand_in", False) or source_digest(original) != digest:
                continue
            stand_in = stand_in_of(original)
            stand_in.memplan_stand_in = True  # type: ignore[attr-defined]
            setattr(owner, name, stand_in)
            replaced.callback(setattr, owner, name, original)
        yield
