"""Ctrl-C that always stops memplan, promptly.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT arrives. A
trace spends much of its time in weakref callbacks and finalizers (lifetimes of fake tensors),
and an exception raised there is printed as "Exception ignored in ..." and dropped: the work went
on. While `reliable_interrupts()` is active, SIGINT also sets a flag, and `raise_if_interrupted()`
(called for every op a trace records, and between traces) raises KeyboardInterrupt again at a
point where it propagates.

Inside `deferred()` (importing torch, building and tracing a model under fake tensors) SIGINT only
sets the flag. There Python code runs as callbacks of torch's C++ (static initialisers at import,
hooks, finalizers, dispatch), and an exception raised at an arbitrary point of such a callback can
cross a C++ frame that cannot pass it on: the process aborted ("terminate called after throwing an
instance of 'python_error'", or pybind11's error_already_set while `import torch` ran; seen in CI
and reproduced by signalling `python -c "import torch"`, 1 abort in 150). The interrupt is raised
instead where an exception is routine: at the next op the trace records (an exception from
__torch_dispatch__ is how torch reports an unsupported op) or where the block ends. A second
Ctrl-C raises at once, for a user who insists.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

requested = False  # read directly on hot paths (one attribute load per recorded op)
# Set by a Ctrl-C during `reliable_interrupts()` and kept after it ends: an exception that follows
# one (cleanup code failing on state the interrupt left half-done) is reported as the interrupt,
# not as an internal error or a usage error.
seen = False
_deferring = 0  # depth of nested `deferred()` blocks


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global requested, seen
    insisted = requested
    requested = seen = True
    if _deferring == 0 or insisted:
        raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    if requested:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C inside only sets the flag (see the module's docstring); it is raised when the block ends."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    raise_if_interrupted()


@contextlib.contextmanager
def reliable_interrupts() -> Iterator[None]:
    """Install the SIGINT handler for the duration (main thread only; elsewhere a no-op)."""
    global requested, seen
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen = False  # kept after the context, for the caller's error handling; cleared for the next
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        requested = False
