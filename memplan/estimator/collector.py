"""Python's cyclic collector kept off the objects a library call finds in the process.

A trace asks Python for every fake tensor it still has (memplan.estimator.swapped_storages,
tensors_python_holds: a full collection, then gc.get_objects()), and a full collection walks every
object the process holds: in a process that imported torch, transformers and DeepSpeed, a million
or so, 0.5 s a collection on this 2-core machine, twice per trace. What exists before memplan
builds anything is no part of the step, so for the call's length it is moved out of the collector's
reach (gc.freeze), as the command line does once per process (memplan.cli.collector, collect_less);
gc.get_objects() leaves frozen objects out too. A process that froze objects of its own (the
command line; a server that forks) is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@contextlib.contextmanager
def existing_objects_frozen() -> Iterator[None]:
    """The objects that exist now out of the collector's reach until the block ends, then back."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def spares_existing_objects(function: Callable[P, R]) -> Callable[P, R]:
    """A library entry point that runs with existing_objects_frozen."""

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with existing_objects_frozen():
            return function(*args, **kwargs)

    return run
