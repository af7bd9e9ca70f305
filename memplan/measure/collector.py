"""Hold Python's cyclic garbage collector still while an iteration is measured.

Tensors that only a reference cycle keeps alive (a module's cached closure, an exception's
frame) are freed when the collector happens to run: at allocation counts that depend on
everything the process did before. A measured peak then moves from run to run (a T5 step moved
by up to 0.7%). Collecting first and disabling the collector during the measured iteration
makes the measurement repeatable: such tensors live to the iteration's end, the most a real
run can hold them within it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
