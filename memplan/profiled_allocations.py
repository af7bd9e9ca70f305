"""What the CPU allocator gave out while one call ran, by torch.profiler's memory events, which see inside kernels
(below the dispatcher's Python layer, where no dispatch mode does): used where a kernel's own temporaries are read
off a real run (memplan.measure.cpu, the validator's counter; memplan.estimator.oprules.rnn, oneDNN's LSTM layers
probed on zeros), and by the tests' own measurements of real runs (tests/hand_measure.py).

The profiler is started as torch.profiler.profile(activities=[CPU], profile_memory=True) starts it, but with
torch's RecordFunction callbacks asked for user scopes only (record_function windows, the optimizers' step
labels), not for every operator: the allocator's events are reported to the profiler apart from those callbacks
(c10's reportMemoryUsage), so they are all kept, and what is left out is one event per op, which the profiler
otherwise times, stores and converts when it stops. Measured on this 2-core machine (torch 2.13, a 300-layer
Linear stack, three AdamW iterations, 52,218 allocator events): stopping took 0.70 s with every op recorded and
0.11 s with user scopes only, and the iterations ran 0.19-0.26 s against 0.13 s."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

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
    with _kineto_lines_dropped(), allocations_recorded() as recording:
        result = call()
    held = peak = 0
    for event in recording.allocator_events():
        held += event.nbytes()
        peak = max(peak, held)
    return result, peak, held


class AllocationRecording:
    """What allocations_recorded recorded, once its block has ended: `kineto_results`, torch's own results object
    (its `events()` and `experimental_event_tree()`, its record_function windows among the events), as
    torch.profiler.profile keeps it in `.profiler`."""

    def __init__(self) -> None:
        self.kineto_results: Any = None

    def allocator_events(self) -> list[Any]:
        """The CPU allocator's events ("[memory]": `nbytes()` positive for an allocation, negative for a free), in
        the order they happened."""
        events = (event for event in self.kineto_results.events() if event.name() == "[memory]")
        return sorted(events, key=lambda event: event.start_ns())


@contextlib.contextmanager
def allocations_recorded() -> Iterator[AllocationRecording]:
    """torch's profiler recording the CPU allocator's events and the record_function windows (user scopes) while
    the block runs, not each op (the module's docstring says why); the results are in the yielded recording once
    the block ends. Profilers cannot nest: raises RuntimeError where one already runs (check profiler_running()
    first): starting this one would end that one, which would find none of its events (torch warns, "disableProfiler
    called but no active profiling session found")."""
    if profiler_running():
        raise RuntimeError(
            "torch's profiler already runs in this process: profilers cannot nest, and starting another would end it "
            "without its events; record outside it"
        )
    from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
    from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope, _ExperimentalConfig

    # The configuration torch.autograd.profiler.profile makes for profile_memory=True (its config()): kineto's
    # state, no shapes, memory, no stacks, no FLOPs, no modules.
    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    recording = AllocationRecording()
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities, {RecordScope.USER_SCOPE})
    # What torch.autograd.profiler.profile tells torch around its own (profiler_running reads it).
    torch.autograd.profiler._run_on_profiler_start()
    try:
        yield recording
    finally:
        try:
            recording.kineto_results = _disable_profiler()
        finally:  # (profiler_running would answer True for the rest of the process)
            torch.autograd.profiler._run_on_profiler_stop()
