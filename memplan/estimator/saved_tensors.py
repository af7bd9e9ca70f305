"""The tensors autograd saves for backward, and how long the graph holding them keeps them (SavedTensors)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.estimator.eager_lifetimes import storage_key


class _Saved:
    """What autograd keeps of one saved tensor while a graph holds it (SavedTensors): the tensor, and what
    SavedVariable keeps to check it was not modified in place before the backward reads it."""

    __slots__ = ("__weakref__", "grad_fn", "output_nr", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, grad_fn: object, output_nr: int) -> None:
        self.tensor, self.version = tensor, tensor._version
        self.grad_fn, self.output_nr = type(grad_fn).__name__ if grad_fn is not None else None, output_nr

    def unpacked(self) -> torch.Tensor:
        """The tensor, refused as SavedVariable::unpack refuses it where an in-place op changed it since it was
        saved (saved_variable.cpp): torch checks the version counter only where no saved_tensors_hooks are
        set, so under SavedTensors' own hooks a step the real run fails ("one of the variables needed for
        gradient computation has been modified by an inplace operation") had been traced, and predicted."""
        current = self.tensor._version
        if current != self.version:
            tensor = self.tensor
            made_by = f", which is output {self.output_nr} of {self.grad_fn}," if self.grad_fn is not None else ""
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{tensor.dtype} {list(tensor.shape)}]{made_by} is at version {current}; expected version "
                f"{self.version} instead. Hint: the real run fails here too; clone the tensor before the in-place "
                "op, or make the op out of place."
            )
        return self.tensor


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """How long the step's autograd graphs hold the tensors they saved for backward.

    A saved tensor lives until its Node has run (the engine releases a Node's saved variables after it,
    engine.cpp evaluate_function) or its graph is dropped, whether or not an op of the backward reads it:
    a formula may use only its size (FftR2CBackward0 saves rfft's input and reads its last dimension's
    size: tests/test_saved_tensors.py's model was 14.6% low, the input freed at its last use in the forward), and a step
    of the user's own may build a graph it never runs backward through (an auxiliary loss kept for logging,
    a forward outside no_grad, the loss it returns). Each saved tensor is packed in a holder whose release
    (by the backward that ran it, or with the graph) is noted at the node count of that moment; a holder
    still alive as the step ends (a graph the step keeps) lives to its end. Inside a non-reentrant
    checkpoint the checkpoint's own hooks pack instead (the innermost hooks do)."""

    def __init__(self, node_count: Callable[[], int], module: Callable[[], str | None] | None = None) -> None:
        self._node_count = node_count
        self._module = module
        # (node count, running module) at every pack, parameters included, in order: a non-reentrant
        # checkpoint's recomputation stops at the pack that matches the forward's last one
        # (memplan.planner.costs, early stop).
        self.packs: list[tuple[int, str | None]] = []
        self._released: dict[StorageWeakRef, int] = {}
        self._finalizers: list[tuple[StorageWeakRef, weakref.finalize]] = []
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Saved | torch.Tensor:
        self.packs.append((self._node_count(), self._module() if self._module is not None else None))
        if isinstance(tensor, nn.Parameter):
            # autograd keeps the parameter itself, not the storage it has now, and a parameter lives through the
            # step anyway: DeepSpeed's ZeRO-3 swaps a layer's gathered weights out of the parameter after its
            # forward (the Linear's context saved it), and noting the gathered storage here kept every layer's
            # gathered weights to the backward (+12 GiB on a llama-3-8b rank)
            return tensor
        # Detached (the same storage and version counter, no grad_fn): a saved output holding its own grad_fn
        # through the holder would be a reference cycle through the graph, never freed.
        holder = _Saved(tensor.detach() if tensor.grad_fn is not None else tensor, tensor.grad_fn, tensor.output_nr)
        key = storage_key(tensor)
        released, node_count = self._released, self._node_count

        def note() -> None:  # holding neither the holder nor its tensor
            released[key] = max(released.get(key, 0), node_count())

        self._finalizers.append((key, weakref.finalize(holder, note)))
        return holder

    @staticmethod
    def _unpack(saved: _Saved | torch.Tensor) -> torch.Tensor:
        return saved.unpacked() if isinstance(saved, _Saved) else saved

    def lifetimes(self, step_end: int) -> list[tuple[StorageWeakRef, int]]:
        """(storage, last node it is alive at) for every saved tensor; the finalizers detached."""
        ends = {key: max(node - 1, 0) for key, node in self._released.items()}
        for key, finalizer in self._finalizers:
            if finalizer.detach() is not None:  # still held as the step ends
                ends[key] = step_end
        self._finalizers.clear()
        return list(ends.items())
