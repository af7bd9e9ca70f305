"""Python's cyclic collector kept off the objects a library call finds in the process.

A trace asks Python for every fake tensor it still has (memplan.estimator.swapped_storages,
tensors_python_holds: a full collection, then gc.get_objects()), and a full collection walks every
object the process holds: in a process that imported torch, transformers and DeepSpeed, a million
or so, 0.5 s a collection on this 2-core machine, twice per trace. What exists before memplan
builds anything is no part of the step, so for the call's length it is moved out of the collector's
reach (gc.freeze), as the command line does once per process (memplan.cli.collector, collect_less);
gc.get_objects() leaves frozen objects out too. A process that froze objects of its own (the
command line; a server that forks) is left as it is.

Whether anything is frozen is asked of gc.get_freeze_count() only where memplan did not freeze the
objects itself (freeze_existing_objects): it counts the frozen objects one by one, 35 ms after the
command line's imports and 0.1 s in a test worker (gcmodule.c, gc_get_freeze_count_impl:
gc_list_size of the permanent generation), paid by every library call, where a flag costs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


# Set while memplan holds the objects frozen that existed when it froze them (a process of its own: the command
# line, a forked worker, the validator's worker; or existing_objects_frozen's block). A process that undoes that
# freeze with gc.unfreeze() instead of unfreeze_objects() leaves this set, and later calls then freeze nothing:
# slower collections, the same answers.
_frozen_by_memplan = False


def freeze_existing_objects() -> None:
    """gc.freeze(), remembered, so that existing_objects_frozen need not count what is frozen."""
    global _frozen_by_memplan
    gc.freeze()
    _frozen_by_memplan = True


def unfreeze_objects() -> None:
    """gc.unfreeze(), remembered: the objects back in the collector's reach."""
    global _frozen_by_memplan
    gc.unfreeze()
    _frozen_by_memplan = False


@contextlib.contextmanager
def existing_objects_frozen() -> Iterator[None]:
    """The objects that exist now out of the collector's reach until the block ends, then back."""
    if _frozen_by_memplan or gc.get_freeze_count():
        yield
        return
    freeze_existing_objects()
    try:
        yield
    finally:
        unfreeze_objects()


def spares_existing_objects(function: Callable[P, R]) -> Callable[P, R]:
    """A library entry point that runs with existing_objects_frozen."""

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with existing_objects_frozen():
            return function(*args, **kwargs)

    return run
