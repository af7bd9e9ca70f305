"""Run independent jobs of the planner in forked copies of this process, one per free core.

Planning traces several checkpointing layouts of one fake model (the solver's answer and every
baseline), and no trace depends on another. A trace is single-threaded Python (fake tensors run no
kernels), so on a 2-core machine two forked traces take about the time of one. Forking, not
spawning, lets each worker start from the model already built under fake tensors in this process:
nothing has to be pickled but the job's argument and its result.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

_job: Callable[[Any], Any] | None = None  # set before the pool forks; each worker inherits it
_log = logging.getLogger(__name__)
_fork_breaks_autograd = False


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def can_fork() -> bool:
    """Whether forked workers can trace: the platform forks, and autograd runs in a forked child.

    Where torch sees a GPU, the first backward starts autograd's device threads and arms a fork
    handler that makes every later backward in a forked child fail ("Unable to handle autograd's
    threading in combination with fork-based multiprocessing": torch/csrc/autograd/engine.cpp,
    Engine::start_device_threads calls track_bad_autograd_forks once it finds a non-CPU device).
    A CUDA build on a machine without a GPU forks fine (checked on 2.11 and 2.14.1 here). Whether
    the handler is armed depends on the build, the devices and what already ran in this process,
    so a child is asked: it runs a one-element backward and exits with its status. A false answer
    is logged (`--debug` shows it) and the work runs in this process instead.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        _log.debug("planning in one process: this platform cannot fork")
        return False
    global _fork_breaks_autograd
    if _fork_breaks_autograd or not _autograd_works_after_fork():
        _fork_breaks_autograd = True  # nothing mends it later in this process
        _log.debug(
            "planning in one process: autograd fails in a forked child of this process "
            "(a CUDA build of torch that sees a GPU, after a backward ran here)"
        )
        return False
    return True


def _autograd_works_after_fork() -> bool:
    pid = os.fork()
    if pid == 0:  # the child: nothing but the probe, then leave without running Python's exit code
        status = 1
        try:
            torch.ones(1, requires_grad=True).sum().backward()
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _start_worker() -> None:
    # A forked child keeps no threads but the one that forked: a lock another thread held at the
    # fork (the progress spinner writing to stderr) would stay held. Workers report nothing.
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the worker)
    # Intra-op threads are not fork-safe (OpenMP), as torch's DataLoader workers also assume.
    torch.set_num_threads(1)


def _run(item: Any) -> Any:
    assert _job is not None
    return _job(item)


def map_forked(job: Callable[[Any], Any], items: Sequence[Any], jobs: int) -> list[Any]:
    """`[job(item) for item in items]`, in up to `jobs` forked workers; in this process when one is enough.

    Items are handed out in order, one at a time: put the longest first. An exception a job
    raises is raised here.
    """
    workers = min(jobs, len(items))
    if workers <= 1 or not can_fork():
        return [job(item) for item in items]
    global _job
    _job = job
    # As gc.freeze's documentation advises for fork without exec: the workers' collections then
    # skip (and do not copy) everything inherited (timed once: a 48-block trace in a worker, -8%).
    gc.freeze()
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker) as pool:
            return pool.map(_run, items, chunksize=1)
    finally:
        gc.unfreeze()
        _job = None
