"""What the CPU allocator gave out while one call ran, by torch.profiler's memory events, which see inside kernels
(below the dispatcher's Python layer, where no dispatch mode does): used where a kernel's own temporaries are read
off a real run (memplan.measure.cpu, the validator's counter; memplan.estimator.oprules.rnn, oneDNN's LSTM layers
probed on zeros)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


@contextlib.contextmanager
def _kineto_lines_dropped() -> Iterator[None]:
    """torch 2.13's profiler writes a line to the process's stderr as it starts and stops ("USDT:...
    SyncActivityProfilerHandler.cpp:52] profiler_start"), from C++, whatever KINETO_LOG_LEVEL says: memplan's answer
    must not print them (an estimate of an LSTM printed 12). The file descriptor is pointed at /dev/null while the
    profiler runs; Python's own sys.stderr is flushed first so nothing written before is lost."""
    descriptor = 2  # the process's stderr, which C++ writes to whatever Python's sys.stderr is (memplan's CLI wraps it)
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stderr.flush()
    try:
        saved = os.dup(descriptor)
    except OSError:  # no stderr at all: nothing to drop
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), descriptor)
        yield
    finally:
        os.dup2(saved, descriptor)
        os.close(saved)


def profiler_running() -> bool:
    """Whether a profiler already runs in this process (profilers cannot nest: a call is then not measured)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def profiled_call(call: Callable[[], T]) -> tuple[T, int, int]:
    """`call()`'s result, the most bytes the CPU allocator had given out at once while it ran (counted from its start),
    and the bytes still given out when it returned (its outputs, for a call that frees what else it made)."""
    from torch.profiler import ProfilerActivity, profile

    with _kineto_lines_dropped(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = call()
    events = sorted(
        (event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return result, peak, held
