"""Ctrl-C that always stops memplan, promptly.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT arrives. A
trace spends much of its time in weakref callbacks and finalizers (lifetimes of fake tensors),
and an exception raised there is printed as "Exception ignored in ..." and dropped: the work went
on. While `reliable_interrupts()` is active, SIGINT also sets a flag, and `raise_if_interrupted()`
(called for every op a trace records, and between traces) raises KeyboardInterrupt again at a
point where it propagates.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

requested = False  # read directly on hot paths (one attribute load per recorded op)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global requested
    requested = True
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    if requested:
        raise KeyboardInterrupt


@contextlib.contextmanager
def reliable_interrupts() -> Iterator[None]:
    """Install the SIGINT handler for the duration (main thread only; elsewhere a no-op)."""
    global requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        requested = False
