"""Replaying memplan's steady-state request sequence through the independent reference allocator.

`recorded_requests(timeline)` records what memplan.estimator.timeline.replay_steady_state asks of an
allocator (mallocs, frees, the peak reset before the last iteration); the functions below replay
that sequence through tests/reference_allocator.py, which shares no code with memplan's simulator.
"""

from __future__ import annotations

from memplan.estimator.timeline import MemoryTimeline, replay_steady_state
from tests.reference_allocator import OutOfMemoryError, ReferenceAllocator

STEP_BYTES = 2 << 20  # segments and pages come in 2 MiB steps


class _Requests:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def malloc(self, num_bytes: int, stream: int = 0) -> int:
        self.calls.append(("malloc", num_bytes))
        return len(self.calls)

    def malloc_or_none(self, num_bytes: int, stream: int = 0) -> int:
        self.calls.append(("malloc or none", num_bytes))  # a cuDNN workspace: skipped where it does not fit
        return len(self.calls)

    def free(self, handle: int) -> None:
        self.calls.append(("free", handle))

    def reset_peak_stats(self) -> None:
        self.calls.append(("reset", 0))


def recorded_requests(timeline: MemoryTimeline) -> list[tuple[str, int]]:
    requests = _Requests()
    replay_steady_state(timeline, requests)  # type: ignore[arg-type]
    return requests.calls


def reference_replay(calls: list[tuple[str, int]], expandable: bool, capacity: int | None) -> ReferenceAllocator:
    """The reference after the calls; raises OutOfMemoryError where a device of `capacity` runs out."""
    reference = ReferenceAllocator(expandable, capacity)
    handles = {}
    for number, (call, value) in enumerate(calls, start=1):
        if call == "malloc":
            handles[number] = reference.malloc(value)
        elif call == "malloc or none":
            try:
                handles[number] = reference.malloc(value)
            except OutOfMemoryError:
                handles[number] = None  # the convolution runs a plan without workspace
        elif call == "free":
            handle = handles.pop(value)
            if handle is not None:
                reference.free(handle)
        else:
            reference.max_reserved_bytes = reference.reserved_bytes  # reset_peak_memory_stats()
    return reference


def reference_smallest_device(calls: list[tuple[str, int]], expandable: bool, low_bytes: int, high_bytes: int) -> int:
    """The least capacity, in 2 MiB steps between the two bounds, in which the reference completes the calls."""
    low, high = -(-low_bytes // STEP_BYTES), -(-high_bytes // STEP_BYTES)
    while low < high:
        middle = (low + high) // 2
        try:
            reference_replay(calls, expandable, middle * STEP_BYTES)
            high = middle
        except OutOfMemoryError:
            low = middle + 1
    return high * STEP_BYTES
