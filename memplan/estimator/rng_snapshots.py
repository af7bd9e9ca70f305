"""The CPU generator's state that torch.utils.checkpoint copies, a real tensor on the CPU target.

`checkpoint(..., preserve_rng_state=True)` (torch's default, memplan's own --checkpoint and Hugging Face's
gradient checkpointing) takes `torch.get_rng_state()` as its forward starts: a uint8 tensor of the CPU
generator's whole state (5,056 B on torch 2.13), which the non-reentrant form keeps in its recompute closure
until the checkpoint's last saved tensor is released, the reentrant form on its ctx until its graph goes; the
recomputation's `torch.random.fork_rng` takes one more while it runs (torch/utils/checkpoint.py,
torch/random.py). Under fake tensors the copy is a real tensor no dispatch sees: each is recorded here as a
storage of its own, allocated where torch.get_rng_state returned it and freed when Python lets it go, as
StorageResize records (memplan.estimator.liveness reads them as FSDP2's resizes). On the cuda target it is host
memory and not counted.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from unittest.mock import patch

import torch

from memplan.distributed.fsdp import StorageResize


class RngSnapshot:
    """The key of one copy of the generator's state (not its storage's address, which a later fake storage may
    reuse once the copy is freed)."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"RngSnapshot({self.number})"


@contextlib.contextmanager
def rng_snapshots_recorded(node_count: Callable[[], int], device: str) -> Iterator[list[StorageResize]]:
    """Each torch.get_rng_state() copy the tracing thread takes while active, as a resize to its bytes at the op
    count `node_count` gives and one back to 0 when it is freed; none unless `device` is the CPU. A copy still alive
    as the trace ends (a step that keeps one) has no free: it reads as live to the step's end, and its callback is
    detached, so neither the recorder nor this list outlives the trace through it."""
    resizes: list[StorageResize] = []
    if device != "cpu":
        yield resizes
        return
    real = torch.get_rng_state
    tracing_thread = threading.get_ident()
    finalizers: list[weakref.finalize] = []

    def get_rng_state() -> torch.Tensor:
        state = real()
        if threading.get_ident() != tracing_thread:  # another thread of the user's program, not the traced step
            return state
        key, nbytes = RngSnapshot(len(finalizers)), state.untyped_storage().nbytes()
        resizes.append(StorageResize(key, node_count(), 0, nbytes))  # type: ignore[arg-type]

        def freed() -> None:  # holding neither the tensor nor anything that holds it
            resizes.append(StorageResize(key, node_count(), nbytes, 0))  # type: ignore[arg-type]

        finalizers.append(weakref.finalize(state, freed))
        return state

    try:
        with patch.object(torch, "get_rng_state", get_rng_state):
            yield resizes
    finally:
        for finalizer in finalizers:
            finalizer.detach()


@contextlib.contextmanager
def rng_snapshots_counted(count: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """`count` given each torch.get_rng_state() copy the measuring thread takes while active: validate's CPU
    counter, a dispatch mode, sees no such copy either (LiveStorageCounter.add_live counts it until it is freed)."""
    real = torch.get_rng_state
    measuring_thread = threading.get_ident()

    def get_rng_state() -> torch.Tensor:
        state = real()
        if threading.get_ident() == measuring_thread:
            count(state)
        return state

    with patch.object(torch, "get_rng_state", get_rng_state):
        yield


def checkpoint_state_bytes(device: str) -> int:
    """What one copy of the generator's state takes on `device`'s memory: the CPU generator's whole state on the
    cpu target (torch.get_rng_state's bytes, 5,056 on torch 2.13), nothing on cuda (host memory there)."""
    return torch.get_rng_state().untyped_storage().nbytes() if device == "cpu" else 0
