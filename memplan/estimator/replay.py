"""The optimizer step recorded once and replayed into later traces of the same fake model.

Planning traces one model under many checkpointing layouts, and the batch-size search traces it at
many batch sizes. The optimizer step is the same in all of them: it reads the parameters, their
optimizer state and the gradients, and checkpointing and batch size change none of their shapes.
With AdamW on a cpu target (one op per parameter and update term) it is a large share of a step:
benchmarks/bench_plan.py prints how many ops of its 48-block GPT-2 step are replayed.

A recording keeps every op of the step with the tensors it read and wrote. A replay adds the same
nodes to a new trace, with each gradient of the recording replaced by the new trace's gradient of
the same parameter, which the new trace's backward produced. It is used only when that exchange is
exact: the new gradients match the recorded ones in shape, strides, dtype, storage offset and
storage size, and every other tensor the step read is one that outlives a trace (parameters,
buffers, optimizer state, the loss scale). Otherwise the step is traced as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.estimator.leaves import tensors_in


@dataclass(frozen=True)
class RecordedOp:
    func: Any  # an aten OpOverload
    args: tuple
    kwargs: dict
    out: object  # the op's output tensors (or a non-tensor result)
    val: object  # the graph node's meta["val"]: detached aliases of `out`


def _layout(tensor: torch.Tensor) -> tuple:
    return (
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
    )


@dataclass
class OptimizerRecording:
    """Ops of one optimizer step, in order; `grads` are the gradients that step consumed."""

    grads: list[torch.Tensor]
    ops: list[RecordedOp] = field(default_factory=list)
    # How long the step's own Python locals kept its tensors (held_tensors.OptimizerLocals): each
    # storage, and the last op it lives through, counted from the step's first op. A replay adds the
    # same ops in the same order, on the same temporaries, so the same offsets hold.
    local_lifetimes: list[tuple[StorageWeakRef, int]] = field(default_factory=list)

    def keep_local_lifetimes(self, lifetimes: Sequence[tuple[StorageWeakRef, int]], step_start: int) -> None:
        self.local_lifetimes = [(key, end - step_start) for key, end in lifetimes]

    def local_lifetimes_from(self, step_start: int) -> list[tuple[StorageWeakRef, int]]:
        """The locals' lifetimes in a trace whose optimizer step begins at node `step_start`."""
        return [(key, step_start + offset) for key, offset in self.local_lifetimes]

    def is_replayable(self, persistent: Sequence[torch.Tensor]) -> bool:
        """Every tensor read from outside the step is a gradient or outlives the trace, and no op
        makes a new view of a gradient (a replay could not rebuild it on the new gradient)."""
        grad_storages = {StorageWeakRef(grad.untyped_storage()) for grad in self.grads}
        known = {id(tensor) for tensor in (*self.grads, *persistent)}
        for op in self.ops:
            inputs = tensors_in((op.args, op.kwargs))
            for tensor in inputs:
                if id(tensor) not in known and isinstance(tensor, torch._subclasses.FakeTensor):
                    return False  # a temporary of the traced forward or backward
            input_ids = {id(tensor) for tensor in inputs}
            for tensor in tensors_in(op.out):
                if id(tensor) not in input_ids and StorageWeakRef(tensor.untyped_storage()) in grad_storages:
                    return False
                known.add(id(tensor))
        return True

    def matches(self, grads: Sequence[torch.Tensor]) -> bool:
        """`grads` stand in exactly for the recorded gradients: same layouts, same sharing of storages."""
        if len(grads) != len(self.grads):
            return False
        pairs: dict[StorageWeakRef, StorageWeakRef] = {}
        for old, new in zip(self.grads, grads, strict=True):
            if _layout(old) != _layout(new):
                return False
            key = StorageWeakRef(old.untyped_storage())
            if pairs.setdefault(key, StorageWeakRef(new.untyped_storage())) != pairs[key]:
                return False
        return len(set(pairs.values())) == len(pairs)

    def substituted(self, grads: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """What replaces each recorded gradient (by id) in a replay."""
        return {id(old): new for old, new in zip(self.grads, grads, strict=True)}
