"""FSDP2, one rank (`--parallel fsdp|fsdp-grad-op --world-size N`): torch's own `fully_shard`.

torch's FSDP2 shards each wrapped module's parameters across the ranks as DTensors and runs on rank
0 of a fake process group over fake tensors (torch.distributed.fsdp._fully_shard). What a rank holds
and does beyond one GPU's step, all of it traced as it runs:
- Its shard of every parameter, gradient and optimizer state: 1/N of each, each dimension-0 shard
  padded to a whole row count (`_fsdp_param.py`, FSDPParam._init_sharded_param).
- Before a wrapped module's forward (and again before its backward, when it resharded after the
  forward), an all-gather: the shards are copied into one flat input buffer (`all_gather_copy_in`),
  gathered into a flat output of N times its size, and copied out into each parameter's unsharded
  storage (`split_with_sizes_copy`). The unsharded storages are allocated for the gather and freed
  when the module reshards: FSDP2 does both with `UntypedStorage.resize_` (its `alloc_storage` and
  `free_storage`), which no dispatch mode sees; memplan records each call as an allocation or a free
  at that point of the step.
- After a module's backward, a reduce-scatter: its unsharded gradients are copied into one flat
  input (`chunk_cat`), reduced into a flat output of 1/N, and added into (or kept as) the sharded
  gradients.
  `fsdp` reshards after the forward (`reshard_after_forward=True`, ZeRO-3-like); `fsdp-grad-op` keeps
  the unsharded parameters from the forward to the backward (`reshard_after_forward=False`,
  ZeRO-2-like). The wrapping policy is the usual one (torchtitan, torch's FSDP2 tutorial): each
  block of the model's repeated blocks, then the root.

The fake group: FSDP2 needs a DeviceMesh, and a DeviceMesh needs torch.distributed's default
process group, so memplan initializes one with torch's "fake" backend (FakeStore,
torch.testing._internal.distributed.fake_pg) while it shards the model and destroys it after: the
sharded model keeps the mesh's group, whose collectives move nothing. A job's own initialized
group is never touched (memplan refuses instead).

On CUDA, FSDP2 allocates the all-gather's buffers on its copy-in stream and the reduce-scatter's output
on its reduce-scatter stream, and the caching allocator keeps each freed block for its own stream; on
the fake CPU tensors of a trace FSDP2 selects torch.cpu's stand-in streams, which the recorder numbers
(memplan.estimator.recorder.current_side_stream) and the allocator simulation keeps apart.

Not traced: NCCL's own buffers, outside torch's allocator (modelled as a band in memplan.distributed.nccl
and counted in the device figure, not here).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest.mock import patch

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.distributed.fake_group import rank_fake_group
from memplan.distributed.offload import HostCopies, HostMemory, host_memory
from memplan.errors import SettingsError
from memplan.estimator.checkpointing import block_names
from memplan.estimator.held_tensors import LIBRARIES_HOLDING_TENSORS
from memplan.estimator.leaves import WRAPPER_SUBCLASSES, tensors_in
from memplan.estimator.opgraph import OpGraph, OpNode
from memplan.estimator.recorder import current_side_stream

# FSDP2's ops around its collectives (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
# `all_gather_copy_in(shards, flat_buffer, ...)` copies the shards into the all-gather's flat buffer,
# the all-gather fills it; `chunk_cat(unsharded_grads, ..., out=flat_input)` copies a module's
# unsharded gradients into the reduce-scatter's flat input, reduced into its flat output, which the
# sharded gradients are views of.
ALL_GATHER_COPY_IN = "fsdp.all_gather_copy_in.default"
REDUCE_SCATTER_COPY_IN = "fsdp.chunk_cat.default"
COLLECTIVE_OPS = frozenset(
    {
        "c10d._allgather_base_.default",
        "c10d._reduce_scatter_base_.default",
        "c10d.allgather_into_tensor_coalesced_.default",
        "c10d.reduce_scatter_tensor_coalesced_.default",
    }
)


@contextlib.contextmanager
def _fake_world(world_size: int, device_type: str, shard_size: int | None = None) -> Iterator[Any]:
    """A DeviceMesh of `world_size` ranks over a fake default process group that lives as long as the rank
    (memplan.distributed.fake_group.rank_fake_group: a real run's step reduces across ranks through it).
    With `shard_size`, HSDP's 2-D mesh: world_size / shard_size replicas by shard_size shards (fully_shard
    then shards over the second dimension and replicates over the first:
    torch/distributed/fsdp/_fully_shard/_fully_shard.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    option = "--parallel hsdp" if shard_size is not None else "--parallel fsdp"
    rank_fake_group(world_size, option)
    with unset_fake_temporarily():  # the mesh's rank tensor must be real
        if shard_size is None:
            mesh = init_device_mesh(device_type, (world_size,))
        else:
            shape = (world_size // shard_size, shard_size)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    yield mesh


@contextlib.contextmanager
def _one_empty_chunk() -> Iterator[None]:
    """FSDP2 splits each parameter into a chunk per rank, and where the ranks outnumber its rows the rest are new
    empty tensors (_fsdp_common.py, `_chunk_with_empty`), of which the rank reads only its own and the first
    (_fsdp_param.py, `_init_sharded_param`, `_init_sharded_post_forward_param_metadata`). Over fake tensors each empty
    one costs a dispatch: 50,740 of them took 10 of the 18 s of tiny-gpt2's estimate on 1,024 ranks. One empty tensor
    stands for them all here; an empty tensor holds no bytes, so no figure changes."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param

    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> list[torch.Tensor]:
        chunks = list(torch.chunk(tensor, num_chunks, dim=dim))
        if len(chunks) < num_chunks:
            chunks += [chunks[0].new_empty(0)] * (num_chunks - len(chunks))
        return chunks

    with patch.object(fsdp_param, "_chunk_with_empty", chunk_with_empty):
        yield


class FullyShardedRank:
    """One rank of a model sharded by FSDP2's fully_shard over fake tensors."""

    def __init__(
        self,
        model: nn.Module,
        world_size: int,
        reshard_after_forward: bool = True,
        mixed_precision: torch.dtype | None = None,
        shard_size: int | None = None,
        offload: bool = False,
        pins_host_memory: bool = False,
    ) -> None:
        """`mixed_precision`: MixedPrecisionPolicy(param_dtype=it, reduce_dtype=torch.float32), or none;
        `shard_size`: HSDP, sharded within groups of that many ranks and replicated across them; `offload`:
        CPUOffloadPolicy (memplan.distributed.offload), whose host memory is pinned where `pins_host_memory`
        (a GPU run's default; made unpinned here, where no GPU is: see after_warm_up)."""
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        if not any(param.requires_grad for param in model.parameters()):
            raise SettingsError("--parallel fsdp: the model has no trainable parameter; leave out --parallel")
        WRAPPER_SUBCLASSES.add(DTensor)
        LIBRARIES_HOLDING_TENSORS.add(os.path.dirname(fsdp_param_group.__file__))  # its buffers' lifetimes
        # The parameters' device: fake CPU tensors in a trace, cuda in a real run on a GPU (validate).
        device_type = next(model.parameters()).device.type
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        policy = MixedPrecisionPolicy(
            param_dtype=mixed_precision, reduce_dtype=torch.float32 if mixed_precision else None
        )
        offload_policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        options = {"reshard_after_forward": reshard_after_forward, "mp_policy": policy}
        options["offload_policy"] = offload_policy
        with _fake_world(world_size, device_type, shard_size) as mesh, _one_empty_chunk():
            for name in block_names(model):
                fully_shard(model.get_submodule(name), mesh=mesh, **options)
            fully_shard(model, mesh=mesh, **options)
        self.module = model  # fully_shard changes it in place (its class becomes an FSDPModule)
        self.offload = offload
        self.pins_host_memory = offload and pins_host_memory

    def shards(self) -> list[torch.Tensor]:
        """This rank's parameter shards (FSDPParam._sharded_param_data: the local tensors, padding included)."""
        return [fsdp_param._sharded_param_data for fsdp_param in _fsdp_params(self.module)]

    def host_memory(
        self, gradients: list[torch.Tensor], optimizer_state: list[torch.Tensor], copies: HostCopies
    ) -> HostMemory:
        """Under offload, the rank's host memory after a traced iteration (memplan.distributed.offload)."""
        return host_memory(self.shards(), gradients, optimizer_state, copies, self.pins_host_memory)

    def buckets(self) -> list[torch.Tensor]:
        return []  # FSDP2 keeps no buffer between modules' collectives; what it gathers is traced

    def after_warm_up(self) -> None:
        """Where a GPU run pins its host memory, FSDP2 told so once its lazy init (which would pin the
        shards: no GPU here to pin for) is done: it then copies each gradient to the host as that run does."""
        if self.pins_host_memory:
            for fsdp_param in _fsdp_params(self.module):
                fsdp_param.pin_memory = True


def _fsdp_params(model: nn.Module) -> Iterator[Any]:
    """The FSDPParam of every parameter fully_shard sharded in `model`: each sharded module's state holds
    its parameter groups (`_fsdp_param_groups` in torch 2.13, one `_fsdp_param_group` before)."""
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            yield from group.fsdp_params


@dataclass(frozen=True)
class StorageResize:
    """FSDP2 resized a storage between two ops: `at` is the index of the next op to run. The same record carries a
    copy of the CPU generator's state made or freed (memplan.estimator.rng_snapshots, keyed by an RngSnapshot)."""

    storage: StorageWeakRef
    at: int
    before_bytes: int
    after_bytes: int
    stream: int = 0  # the side stream it ran on (memplan.estimator.recorder.current_side_stream), 0 the default


StorageResized = Callable[[torch.UntypedStorage, int, int], None]  # (storage, bytes before, bytes after)


@contextlib.contextmanager
def storage_resizes_observed(on_resize: StorageResized) -> Iterator[None]:
    """`on_resize` told of each storage FSDP2 resizes (its alloc_storage and free_storage, in
    _fsdp_param.py; _fsdp_param_group.py imports alloc_storage for one-rank groups) while active."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group

    def observed(resize: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def run(tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            before = storage.nbytes()
            resize(tensor)
            if storage.nbytes() != before:
                on_resize(storage, before, storage.nbytes())

        return run

    allocate, free = observed(fsdp_param.alloc_storage), observed(fsdp_param.free_storage)
    with (
        patch.object(fsdp_param, "alloc_storage", allocate),
        patch.object(fsdp_param, "free_storage", free),
        patch.object(fsdp_param_group, "alloc_storage", allocate),
    ):
        yield


@contextlib.contextmanager
def storage_resizes_recorded(
    node_count: Callable[[], int], data_parallel: object, stream_numbers: dict[object, int]
) -> Iterator[list[StorageResize]]:
    """FSDP2's resizes while active, as StorageResize records at the op count `node_count` gives, their
    streams numbered in `stream_numbers` (the recorder's); none unless `data_parallel` is a
    FullyShardedRank."""
    resizes: list[StorageResize] = []
    if not isinstance(data_parallel, FullyShardedRank):
        yield resizes
        return

    def record(storage: torch.UntypedStorage, before: int, after: int) -> None:
        stream = current_side_stream(stream_numbers) or 0
        resizes.append(StorageResize(StorageWeakRef(storage), node_count(), before, after, stream))

    with storage_resizes_observed(record):
        yield resizes


def sharding_categories(graph: OpGraph, resizes: list[StorageResize]) -> dict[StorageWeakRef, str]:
    """The breakdown category of what FSDP2 allocates, where nothing else has one (the shards are
    parameters, the sharded gradients gradients): its unsharded parameter storages; the unsharded
    gradients a reduce-scatter copies in; the collectives' flat buffers ("communication"). Without
    resizes no FSDP2 ran, and the graph is not read."""
    if not resizes:
        return {}
    categories = {resize.storage: "unsharded_parameters" for resize in resizes}

    def categorize(values: list[object], category: str) -> None:
        for value in values:
            if isinstance(value, OpNode):
                for tensor in tensors_in(value.meta.get("val")):
                    categories.setdefault(StorageWeakRef(tensor.untyped_storage()), category)

    for node in graph.nodes:
        target = str(node.target) if node.op == "call_function" else None
        if target == REDUCE_SCATTER_COPY_IN:  # its out= buffer is the reduce-scatter's input: below
            categorize(node.args[0], "gradients")
        elif target == ALL_GATHER_COPY_IN or target in COLLECTIVE_OPS:
            categorize([node, *node.all_input_nodes], "communication")
    return categories
