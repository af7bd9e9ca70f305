"""memplan.distributed.deepspeed_collectives: the stand-in for DeepSpeed's reduce_scatter_coalesced makes the
allocations DeepSpeed's own function makes, in its order, and returns the same views of them. The oracle is
DeepSpeed's function itself, run on the same fake tensors and watched by a dispatch mode of this file's (no
memplan code on that side); the whole rank against the real run is tests/test_distributed_deepspeed.py."""

from __future__ import annotations

import gc
from typing import Any

import deepspeed.runtime.comm.coalesced_collectives as coalesced
import deepspeed.runtime.zero.stage3 as stage3
import pytest
import torch
from deepspeed import comm as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.distributed.deepspeed_collectives import (
    coalesced_wait_of,
    padding_sizes,
    per_rank_loops_replaced,
    reduce_scatter_coalesced_of,
)


class NewStorages(TorchDispatchMode):
    """Each storage an op's output brings into being, in order: (bytes, dtype), and a weak reference to it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[StorageWeakRef] = set()
        self.made: list[tuple[int, torch.dtype]] = []
        self.refs: list[StorageWeakRef] = []

    def know(self, tensors: list[torch.Tensor]) -> None:
        self.seen.update(StorageWeakRef(tensor.untyped_storage()) for tensor in tensors)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, list | tuple) else [out]:
            if isinstance(tensor, torch.Tensor):
                ref = StorageWeakRef(tensor.untyped_storage())
                if ref not in self.seen:
                    self.seen.add(ref)
                    self.made.append((tensor.untyped_storage().nbytes(), tensor.dtype))
                    self.refs.append(ref)
        return out


def _run(function: Any, shapes: list[tuple[int, ...]], world_size: int, rank: int, dtype: torch.dtype) -> dict:
    """What `function` allocates over fake tensors of `shapes`, which allocations its outputs keep, and the outputs'
    shapes and places in them."""
    with FakeTensorMode():
        tensors = [torch.empty(shape, dtype=dtype) for shape in shapes]
        watch = NewStorages()
        watch.know(tensors)
        with watch:
            outputs = function(tensors, None)
        gc.collect()
        kept = [not ref.expired() for ref in watch.refs]
        index = {ref: position for position, ref in enumerate(watch.refs)}
        placed = [
            (tuple(out.shape), out.storage_offset(), index.get(StorageWeakRef(out.untyped_storage()), "input"))
            for out in outputs
        ]
    return {"made": watch.made, "kept": kept, "outputs": placed}


CASES = [
    (4, [(16,)], 1),  # one tensor the ranks divide: DeepSpeed reduces in place, no buffer
    (4, [(8,), (3, 5)], 0),
    (7, [(10,)], 3),  # a short last chunk, and ranks past the end
    (7, [(48,), (6,), (5, 7)], 6),
    (5, [(0,), (6,)], 4),  # an empty tensor
    (96, [(50,), (3, 40), (200,)], 95),  # more ranks than some tensors have elements
    (512, [(768,), (64, 64)], 1),
]


@pytest.mark.parametrize(("world_size", "shapes", "rank"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stand_in_allocates_what_deepspeed_does_and_returns_the_same_views(
    monkeypatch, world_size, shapes, rank, dtype
):
    scattered: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def reduce_scatter(input_tensor, output_tensor, group=None, async_op=False, prof=False):
        scattered.append((tuple(input_tensor.shape), tuple(output_tensor.shape)))

    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(coalesced, "_torch_reduce_scatter_fn", reduce_scatter)

    deepspeeds = _run(coalesced.reduce_scatter_coalesced, shapes, world_size, rank, dtype)
    deepspeeds_calls, scattered[:] = list(scattered), []
    stand_in = reduce_scatter_coalesced_of(coalesced.reduce_scatter_coalesced)
    memplans = _run(stand_in, shapes, world_size, rank, dtype)
    assert memplans == deepspeeds
    assert scattered == deepspeeds_calls


def test_a_real_tensor_goes_to_deepspeeds_own_function():
    calls = []
    stand_in = reduce_scatter_coalesced_of(lambda tensors, group=None: calls.append(tensors) or ["deepspeed's"])
    assert stand_in([torch.zeros(4)]) == ["deepspeed's"] and len(calls) == 1


@pytest.mark.parametrize(
    ("numel", "world_size"),
    [(10, 7), (48, 7), (0, 5), (6, 5), (768, 1024), (16, 4), (1, 3), (4096, 1024), (4097, 1024)],
)
def test_padding_is_what_deepspeeds_slices_leave_short(numel, world_size):
    """Worked as DeepSpeed slices: rank r's chunk is elements [r·c, r·c + c) of the tensor, c = ceil(n / ranks),
    cut short at its end; whatever falls short of c is padding."""
    chunk = -(-numel // world_size)
    elements = list(range(numel))
    expected = [
        (rank, chunk - len(elements[rank * chunk : rank * chunk + chunk]))
        for rank in range(world_size)
        if len(elements[rank * chunk : rank * chunk + chunk]) < chunk
    ]
    assert padding_sizes(numel, world_size) == expected


def test_the_stand_in_is_in_place_only_while_the_rank_runs_and_only_for_the_function_it_was_written_from(monkeypatch):
    from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle
    from deepspeed.utils import instrument_w_nvtx

    original, wait = stage3.reduce_scatter_coalesced, AllGatherCoalescedHandle.wait
    with per_rank_loops_replaced():
        assert stage3.reduce_scatter_coalesced is not original and AllGatherCoalescedHandle.wait is not wait
        assert stage3.reduce_scatter_coalesced.memplan_stand_in and AllGatherCoalescedHandle.wait.memplan_stand_in
    assert stage3.reduce_scatter_coalesced is original and AllGatherCoalescedHandle.wait is wait

    # another version, under the same decorator (whose wrapper's own source was all that was hashed at first)
    @instrument_w_nvtx
    def another_version(tensors, group=None):
        return tensors

    monkeypatch.setattr(stage3, "reduce_scatter_coalesced", another_version)
    with per_rank_loops_replaced():
        assert stage3.reduce_scatter_coalesced is another_version
        assert AllGatherCoalescedHandle.wait.memplan_stand_in


def _gathered(wait: Any, numels: list[int], world_size: int, dtype: torch.dtype, partition_dtype: torch.dtype) -> dict:
    """What `wait` allocates for a coalesced gather of parameters of `numels` elements over `world_size` ranks (a
    flat buffer of one padded partition per rank), and what each parameter's data is then."""
    from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle, ZeroParamStatus

    class Done:
        def wait(self) -> None:
            pass

    with FakeTensorMode():
        params = []
        for numel in numels:
            param = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            shard = -(-numel // world_size)
            param.ds_numel, param.ds_shape, param.ds_status = numel, (numel,), ZeroParamStatus.INFLIGHT
            param.ds_tensor = torch.empty(shard, dtype=dtype)
            param.ds_tensor.ds_numel = shard
            params.append(param)
        row = sum(param.ds_tensor.ds_numel for param in params)
        flat = torch.empty(world_size * row, dtype=partition_dtype)
        partitions = [flat.narrow(0, row * rank, row) for rank in range(world_size)]
        handle = AllGatherCoalescedHandle(Done(), params, partitions, world_size)
        watch = NewStorages()
        watch.know([flat, *(param.ds_tensor for param in params), *(param.data for param in params)])
        with watch:
            wait(handle)
        data = [(tuple(p.data.shape), p.data.dtype, p.data.storage_offset(), p.ds_status.name) for p in params]
    return {"made": watch.made, "data": data, "complete": handle.complete}


@pytest.mark.parametrize(
    ("numels", "world_size"),
    [([10], 3), ([64, 4096, 7], 8), ([5, 1], 7), ([768, 64], 512), ([12], 4)],
)
@pytest.mark.parametrize("partition_dtype", [torch.float32, torch.bfloat16])
def test_the_wait_stand_in_makes_each_parameter_as_deepspeed_does(numels, world_size, partition_dtype):
    """Each parameter's buffer (torch.cat's output, then its cast where the gather ran in another dtype), in
    DeepSpeed's order, and the parameter's data pointed at it."""
    from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle

    original = AllGatherCoalescedHandle.wait
    deepspeeds = _gathered(original, numels, world_size, torch.float32, partition_dtype)
    memplans = _gathered(coalesced_wait_of(original), numels, world_size, torch.float32, partition_dtype)
    assert memplans == deepspeeds and deepspeeds["complete"]
