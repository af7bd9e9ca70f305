"""The buffer the backward of a view changed in place allocates on real tensors, and not on fake ones.

After an in-place op on a view of a tensor that requires grad (`nn.SiLU(inplace=True)` on InstanceNorm2d's
output, which is a view of batch norm's; `x.permute(...).relu_()`), autograd gives the base a CopySlices
Node and regenerates the view's grad_fn the next time the view is used. For an ordinary CPU or CUDA tensor
the regenerated Node is an AsStridedBackward0 (torch/csrc/autograd/variable.cpp, VariableHooks::grad_fn:
as_strided unless the tensor has a view function), whose backward (as_strided_backward in
FunctionsManual.cpp) allocates `grad.new_zeros(the base's storage size)` and hands it on as the base's
gradient, which the CopySlices Node consumes. A FakeTensor has the Python dispatch key, so autograd replays
the view instead (a PermuteBackward0, a ViewBackward0), whose backward allocates nothing: the trace missed
one base-sized buffer per such view, alive from its Node to the end of the CopySlices Node's formula (the
checkpointed InstanceNorm + in-place SiLU stack of tests/test_regenerated_views.py was 262,148 B low). Here
that allocation is made in the trace, at the regenerated Node, and told to live until the CopySlices Node's
formula returns; and as as_strided_backward does, the Node hands the buffer on, the incoming gradient copied in,
so that its incoming gradient goes as it returns (the replayed view handed CopySlices a view of it, which
CopySlices held through its formula: nn.Linear on a 3-D input then ReLU(inplace=True) was 16,636 B high).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.estimator.leaves import local_tensor


def writes_first_argument(func: Any) -> bool:
    """Whether the op writes its first argument (its schema marks it `Tensor(a!)`: an in-place op, `x.add_(y)`)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


class RegeneratedViews:
    """Watches the ops of a traced step (from EagerLifetimes' dispatch): views changed in place, then the Node
    autograd regenerates for each at its next use."""

    def __init__(self, node_count: Callable[[], int], lifetimes: list[tuple[StorageWeakRef, int]]) -> None:
        self._node_count = node_count
        self._lifetimes = lifetimes
        # id(view) -> (the view, weakly; bytes of its base's storage, its dtype)
        self._changed: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.dtype]] = {}

    def before(self, func: Any, args: tuple) -> None:
        """`func` is about to run on `args`: a changed view among them has its regenerated Node by now
        (autograd collects an op's next edges before it dispatches the op)."""
        changes_a_view = self._changes_a_view(func, args)
        if not self._changed and not changes_a_view:
            return
        for arg in args:
            if isinstance(arg, torch.Tensor) and id(arg) in self._changed:
                reference, nbytes, dtype = self._changed.pop(id(arg))
                if reference() is arg and arg.grad_fn is not None:
                    self._hook(arg.grad_fn, nbytes, dtype)
        if changes_a_view:
            view = args[0]
            base_bytes = local_tensor(view._base).untyped_storage().nbytes()
            self._changed[id(view)] = (weakref.ref(view), base_bytes, view.dtype)

    @staticmethod
    def _changes_a_view(func: Any, args: tuple) -> bool:
        return (
            bool(args)
            and isinstance(args[0], torch.Tensor)
            and args[0]._is_view()
            and args[0].requires_grad
            and torch.is_grad_enabled()
            and writes_first_argument(func)
        )

    def _hook(self, node: Any, nbytes: int, dtype: torch.dtype) -> None:
        if type(node).__name__ == "AsStridedBackward0" or not node.next_functions:
            return  # a real tensor's Node already (or no base to hand a gradient to)
        copy_slices = node.next_functions[0][0]
        if type(copy_slices).__name__ != "CopySlices":
            return
        held: list[torch.Tensor] = []

        def allocate(grad_outputs: object) -> None:
            held.append(torch.zeros(nbytes // dtype.itemsize, dtype=dtype))

        def hand_on(grad_inputs: tuple, grad_outputs: object) -> tuple | None:
            # as_strided_backward copies the incoming gradient into the buffer and returns the buffer: the
            # CopySlices Node reads the buffer, and the incoming gradient goes as this Node returns (the replayed
            # view's gradient, a view of the incoming one, would have held it through CopySlices' formula).
            gradient = grad_inputs[0] if grad_inputs else None
            if not held or not isinstance(gradient, torch.Tensor) or gradient.dtype != dtype:
                return None
            span = gradient.storage_offset() + sum(
                (size - 1) * step for size, step in zip(gradient.shape, gradient.stride(), strict=True)
            )
            if gradient.numel() == 0 or span >= held[-1].numel():
                return None
            handed = torch.as_strided(held[-1], gradient.shape, gradient.stride(), gradient.storage_offset())
            handed.copy_(gradient)
            return (handed, *grad_inputs[1:])

        def release(grad_inputs: object, grad_outputs: object) -> None:
            if held:
                self._lifetimes.append((StorageWeakRef(held.pop().untyped_storage()), self._node_count() - 1))

        node.register_prehook(allocate)
        node.register_hook(hand_on)
        copy_slices.register_hook(release)
