"""Python's cyclic collector in the `memplan` process, which imports torch, traces and exits
(memplan.cli.running calls these). A library call in anyone's process keeps the collector off what
it finds there by itself: memplan.estimator.collector."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
from collections.abc import Iterator

from memplan.estimator.collector import freeze_existing_objects


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """Python's cyclic collector off while torch is imported. The import makes about a million objects and
    hardly any garbage, yet with the collector on every full collection walks all that exist so far, and
    one falls due each time their number has grown by a quarter: `import torch, transformers, torch._dynamo`
    then the gpt2 modelling took 4.0-4.5 s with it on and 3.2 s with it off, three runs each (2026-11-29, this
    2-core machine). What torch's import leaves is then frozen (collect_less), so later imports and the
    trace do not walk it either."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@functools.cache
def collect_less() -> None:
    """A command traces and exits. Python's cyclic collector would walk the objects torch's import made
    (a million or so) at every full collection while the trace makes its own, which live until the
    answer is printed: once torch is imported (_run), the objects there are moved out of its reach
    (gc.freeze) and it runs less often. The gpt2 estimate's phases in one process: 4.34 s, 3.69 s so,
    3.60 s with no collector at all; peak RSS 366, 370 and 379 MiB (`python
    benchmarks/estimate_phases.py [--collect-less | --no-collector]`, 2026-11-25). Once per process
    (the test suite runs many commands in one); a measured iteration still holds the collector itself."""
    freeze_existing_objects()
    gc.set_threshold(50_000, 20, 20)


@functools.cache
def collect_before_teardown() -> None:
    """Free the failed work's objects at exit, before the interpreter tears its modules down (atexit
    handlers run first), so that their finalizers still find torch intact. Registered once (cached),
    not run at each error: a full collection over a large heap takes a good part of a second, which
    every refused command would pay (the test suite's hundred refusals in one process did)."""
    atexit.register(gc.collect)
