"""C++ composites whose variables hold tensors past their last use by an op, watched while a step is traced.

Some of torch's functions run as one C++ function that calls many ops (a CompositeImplicitAutograd kernel:
ATen's recurrent layers, the math path of scaled_dot_product_attention, several losses). memplan sees the ops,
not the C++ variables: one that holds a tensor after the last op that reads it keeps it alive until the variable
is assigned again or the function returns. For each such function a rule (memplan.estimator.rnn_layers,
memplan.estimator.math_attention, memplan.estimator.composite_losses) reads the ops one call ran and says until
which op each such tensor lives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from unittest.mock import patch

import torch
import torch.nn.functional as F

from memplan.estimator.leaves import storage_key, tensors_in


@dataclass(frozen=True)
class CompositeOp:
    """One op a C++ composite ran: the storage of its first argument (None where it is no tensor), those of
    its outputs, the last graph node it made (or the one before it, where it made none), and the storages of all
    its tensor arguments (a list's among them: at::stack's, at::cat's)."""

    func: Any
    argument_storage: object
    output_storages: frozenset[object]
    end: int
    argument_storages: frozenset[object]

    @classmethod
    def of(cls, func: Any, args: tuple[Any, ...], out: object, end: int) -> CompositeOp:
        """The op `func` that ran on `args` and returned `out`."""
        first = storage_key(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        return cls(
            func,
            first,
            frozenset(storage_key(tensor) for tensor in tensors_in(out)),
            end,
            frozenset(
                storage_key(tensor)
                for argument in args
                for tensor in (argument if isinstance(argument, list | tuple) else (argument,))
                if isinstance(tensor, torch.Tensor)
            ),
        )


# (an op a composite dispatches, its arguments, the composite's ops so far) -> the op its plain path runs instead
PlainOpRule = Callable[[Any, tuple[Any, ...], list[CompositeOp]], Any]


class CompositeWatcher(Protocol):
    composite_ops: list[CompositeOp] | None
    composite_plain_op: PlainOpRule | None
    local_lifetimes: list[tuple[Any, int]]


HeldRule = Callable[[list[CompositeOp], tuple[Any, ...], dict[str, Any]], list[tuple[object, int]]]


def watched(watcher: CompositeWatcher, function: Callable[..., Any], held: HeldRule) -> Callable[..., Any]:
    """`function`, whose call records the ops it runs (`watcher.composite_ops`) and adds what `held` says of them,
    (storage, the last node it lives through), to `watcher.local_lifetimes`. A call inside another watched one is
    left to the outer one's rule."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if watcher.composite_ops is not None:
            return function(*args, **kwargs)
        watcher.composite_ops = ops = []
        try:
            result = function(*args, **kwargs)
        finally:
            watcher.composite_ops = None
        watcher.local_lifetimes.extend(held(ops, args, kwargs))
        return result

    return run


_ADD, _ADD_IN_PLACE = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor
_MATRIX_PRODUCTS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.bmm.default})
# The ops at::matmul ends a product with: the product, or the view of a folded or batched one.
_PRODUCT_ENDS = _MATRIX_PRODUCTS | {torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default}


def _promotes_to(result: torch.dtype, other: torch.dtype) -> bool:
    """Whether `result + other` has result's dtype (torch.promote_types is an op the trace would record)."""
    if other in (result, torch.bool):
        return True
    return result.is_floating_point and other.is_floating_point and other.itemsize < result.itemsize


def added_in_place(func: Any, args: tuple[Any, ...], ops: list[CompositeOp]) -> Any:
    """`product.add_(other)` for `product.add(other)` where `product` is what the composite's at::matmul has just
    made (the op before): the plain path of a C++ composite whose `at::areAnyTensorSubclassLike` branch adds out of
    place for a tensor subclass, which a fake tensor is (memplan.estimator.math_attention, memplan.estimator.linear)."""
    if func is not _ADD or len(args) < 2 or not ops or ops[-1].func not in _PRODUCT_ENDS:
        return func
    product, other = args[0], args[1]
    if not isinstance(product, torch.Tensor) or not isinstance(other, torch.Tensor):
        return func
    if not any(op.func in _MATRIX_PRODUCTS for op in ops):
        return func
    if storage_key(product) not in ops[-1].output_storages:
        return func
    keeps = torch.broadcast_shapes(product.shape, other.shape) == product.shape and _promotes_to(
        product.dtype, other.dtype
    )
    return _ADD_IN_PLACE if keeps else func


def _nothing_held(ops: list[CompositeOp], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[object, int]]:
    return []


@contextlib.contextmanager
def plain_path_patched(
    watcher: CompositeWatcher, owner: Any, name: str, plain_op: PlainOpRule, held: HeldRule = _nothing_held
) -> Iterator[None]:
    """`owner.name` (a composite with a tensor-subclass branch, F.linear, F.scaled_dot_product_attention) watched
    (`watched`), with `plain_op` choosing, while it runs, the op its plain path runs for each op it dispatches
    (`watcher.composite_plain_op`): under fake tensors, and under any dispatch mode (at::isTensorSubclassLike checks
    c10::impl::dispatch_mode_enabled), the composite takes its subclass branch."""
    call = watched(watcher, getattr(owner, name), held)

    def run(*args: Any, **kwargs: Any) -> Any:
        outer, watcher.composite_plain_op = watcher.composite_plain_op, plain_op
        try:
            return call(*args, **kwargs)
        finally:
            watcher.composite_plain_op = outer

    with patch.object(owner, name, run):
        yield


@contextlib.contextmanager
def plain_paths_tracked(watcher: CompositeWatcher) -> Iterator[None]:
    """The composites' plain paths alone (nothing held beyond what runs): for a dispatch mode over a real run
    (memplan.measure.cpu's counter), under which the composites take their subclass branches too."""
    from memplan.estimator.linear import linear_tracked
    from memplan.estimator.math_attention import plain_attention_op

    with plain_path_patched(watcher, F, "scaled_dot_product_attention", plain_attention_op), linear_tracked(watcher):
        yield


@contextlib.contextmanager
def composites_tracked(watcher: CompositeWatcher) -> Iterator[None]:
    from memplan.estimator.composite_losses import composite_losses_tracked
    from memplan.estimator.linear import linear_tracked
    from memplan.estimator.math_attention import math_attention_tracked
    from memplan.estimator.rnn_layers import rnn_projections_tracked

    with (
        rnn_projections_tracked(watcher),
        math_attention_tracked(watcher),
        composite_losses_tracked(watcher),
        linear_tracked(watcher),
    ):
        yield
