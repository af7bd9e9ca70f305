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


@dataclass(frozen=True)
class CompositeOp:
    """One op a C++ composite ran: the storage of its first argument (None where it is no tensor), those of
    its outputs, and the last graph node it made (or the one before it, where it made none)."""

    func: Any
    argument_storage: object
    output_storages: frozenset[object]
    end: int


class CompositeWatcher(Protocol):
    composite_ops: list[CompositeOp] | None
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


@contextlib.contextmanager
def composites_tracked(watcher: CompositeWatcher) -> Iterator[None]:
    from memplan.estimator.composite_losses import composite_losses_tracked
    from memplan.estimator.math_attention import math_attention_tracked
    from memplan.estimator.rnn_layers import rnn_projections_tracked

    with rnn_projections_tracked(watcher), math_attention_tracked(watcher), composite_losses_tracked(watcher):
        yield
