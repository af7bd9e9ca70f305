"""FSDP2's CPU offload (`--offload params`): what of a rank lives in host memory, and the copies between.

torch's FSDP2 with `CPUOffloadPolicy` (torch/distributed/fsdp/_fully_shard/_fsdp_api.py) keeps a rank's
parameter shards, their gradients and the optimizer state in host memory:
- the shards are made on the host, pinned by default (`_fsdp_param.py`, FSDPParam._init_sharded_param:
  `.cpu()`, then `.pin_memory()`);
- before each all-gather every shard is copied to the GPU (`all_gather_inputs`:
  `sharded_param_data.to(self.device, non_blocking=True)`), a transient the copy-in frees;
- after each reduce-scatter every reduced gradient shard is copied to the host
  (`_fsdp_collectives.py`, foreach_reduce: `new_sharded_grad.to(torch.device("cpu"), non_blocking=...)`,
  non-blocking into pinned memory unless it is added into an existing gradient), and the GPU's
  reduce-scatter output is freed;
- so the optimizer's step runs on host tensors, and its state and temporaries are made there (torch.optim
  picks its for-loop implementation for CPU tensors: `_default_to_fused_or_foreach`, torch/optim/optimizer.py).

memplan traces on fake CPU tensors for either target, where both copies are a `.to()` to the tensor's own
device, which returns the tensor itself. `copies_made` makes each of them a copy, as a GPU run makes
it, and notes which are host memory; `host_memory` names all the rank's host memory after the trace,
which the simulation keeps out of the GPU's figures and counts as `host_peak_bytes`.

Pinned host memory is allocated by torch's CachingHostAllocator, which rounds every request up to a
power of two (ATen/core/CachingHostAllocator.h: `roundSize = c10::llvm::PowerOf2Ceil(size)`) and keeps
freed blocks cached: on the cuda target the pinned storages (the shards, and the gradients copied
without accumulation) are counted at that size. On the cpu target nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# The FSDP2 files whose same-device `.to(device)` calls are copies between the GPU and the host under
# CPUOffloadPolicy (the lines quoted above), and which way each copies.
_TO_DEVICE = "_fsdp_param.py"  # the shards to the GPU for the all-gather
_TO_HOST = "_fsdp_collectives.py"  # the reduced gradient shards to the host


def pinned_host_bytes(nbytes: int) -> int:
    """What torch's CachingHostAllocator takes for a pinned request of `nbytes` (the next power of two)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


@dataclass
class HostCopies:
    """The copies FSDP2 made to the host while `copies_made` was active: whether each was non-blocking
    (into pinned memory)."""

    non_blocking: dict[StorageWeakRef, bool] = field(default_factory=dict)
    making: bool = False  # while a host copy is being made (or, under DeepSpeed's offload, the host computes)
    # Told of each host copy once made (the CPU validator's counter, which leaves host memory out).
    observers: list[Callable[[torch.Tensor], None]] = field(default_factory=list)


# DeepSpeed's ZeRO-3 under offload_optimizer (runtime/zero/stage3.py): the functions whose `.to(device)` of a
# gradient partition's host buffer is a copy to the GPU (partition_grads: the buffer brought over to be
# accumulated into and its norm taken, then dropped; the unmanaged path's finalization the same).
_DEEPSPEED_TO_DEVICE = frozenset({"partition_grads", "_finalize_offload_gradient_accumulation"})


def _copy_direction(frame: Any, data_parallel: object, tensor: torch.Tensor) -> str | None:
    """Which of FSDP2's or DeepSpeed's offload copies the `.to()` of `tensor` called from `frame` is, if any.
    DeepSpeed's ZeRO-3 under offload_param gathers a parameter from its partition on the host
    (partition_parameters.py: `ds_tensor.to(current_device_name())` before each all-gather, on every path
    it takes): those of `data_parallel.host_parameter_storages` are copies to the GPU."""
    if frame is None:
        return None
    path = frame.f_code.co_filename
    if path.endswith(os.path.join("zero", "stage3.py")) and frame.f_code.co_name in _DEEPSPEED_TO_DEVICE:
        return "device"
    if path.endswith(os.path.join("zero", "partition_parameters.py")):
        on_host = getattr(data_parallel, "host_parameter_storages", frozenset())
        return "device" if on_host and StorageWeakRef(tensor.untyped_storage()) in on_host else None
    if os.path.basename(os.path.dirname(path)) != "_fully_shard":
        return None
    return {_TO_DEVICE: "device", _TO_HOST: "host"}.get(os.path.basename(path))


def _targets_a_device(args: tuple, kwargs: dict) -> bool:
    return "device" in kwargs or any(isinstance(arg, torch.device | str) for arg in args)


@contextlib.contextmanager
def copies_made(data_parallel: object) -> Iterator[HostCopies]:
    """While active, FSDP2's offload copies are made where `data_parallel` offloads (else nothing changes).

    `Tensor.to` itself is wrapped for the while: a torch function mode would miss the copies FSDP2 makes
    in the backward, whose hooks the autograd engine runs without the caller's torch function modes."""
    copies = HostCopies()
    if not getattr(data_parallel, "offload", False):
        yield copies
        return
    original = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(self, *args, **kwargs)
        if out is not self or not _targets_a_device(args, kwargs):
            return out
        direction = _copy_direction(sys._getframe(1), data_parallel, self)
        if direction is None:
            return out
        copies.making = direction == "host"
        try:
            copy = out.clone()
        finally:
            copies.making = False
        if direction == "host":
            copies.non_blocking[StorageWeakRef(copy.untyped_storage())] = bool(kwargs.get("non_blocking", False))
            for observe in copies.observers:
                observe(copy)
        return copy

    torch.Tensor.to = to  # type: ignore[method-assign]
    try:
        yield copies
    finally:
        torch.Tensor.to = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class HostMemory:
    """A rank's host memory under CPU offload (the optimizer step's allocations besides: it runs there)."""

    storages: frozenset[StorageWeakRef]
    pinned: frozenset[StorageWeakRef]  # allocated by the CachingHostAllocator (cuda target only)
    # The nodes [start, end) during which the host computes, whose allocations are the host's; None: the
    # whole optimizer step (FSDP2's, which runs on the host).
    windows: tuple[tuple[int, int], ...] | None = None

    def bytes_of(self, storage: StorageWeakRef, nbytes: int) -> int:
        """The host bytes a storage of `nbytes` takes."""
        return pinned_host_bytes(nbytes) if storage in self.pinned else nbytes


def host_memory(
    shards: list[torch.Tensor],
    gradients: list[torch.Tensor],
    optimizer_state: list[torch.Tensor],
    copies: HostCopies,
    pins: bool,
) -> HostMemory:
    """The rank's host memory: its parameter shards, gradients and optimizer state (local tensors), and
    the gradient copies FSDP2 made. Where `pins` (a GPU run: CPUOffloadPolicy(pin_memory=True)), the
    shards and the copies FSDP2 made non-blocking are pinned."""
    keys = [StorageWeakRef(tensor.untyped_storage()) for tensor in shards]
    others = [StorageWeakRef(tensor.untyped_storage()) for tensor in [*gradients, *optimizer_state]]
    pinned = {*keys, *(key for key, non_blocking in copies.non_blocking.items() if non_blocking)} if pins else set()
    return HostMemory(storages=frozenset([*keys, *others, *copies.non_blocking]), pinned=frozenset(pinned))
