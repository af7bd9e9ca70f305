"""Run independent traces in forked copies of this process, one per free core.

Planning traces several checkpointing layouts of one fake model (the solver's answer and every
baseline), and no trace depends on another; an estimate traces a second batch size for the per-sample
slope beside its first (ForkedJob). A trace is single-threaded Python (fake tensors run no kernels), so
on a 2-core machine two forked traces take about the time of one. Forking, not spawning, lets each
worker start from the model already built under fake tensors in this process: nothing has to be
pickled but the job's argument and its result.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.estimator.collector import freeze_existing_objects

_job: Callable[[Any], Any] | None = None  # set before the pool forks; each worker inherits it
_log = logging.getLogger(__name__)
_fork_breaks_autograd = False
# A probe found autograd working in a forked child where torch has no device backend (_autograd_works_after_fork).
_fork_keeps_autograd = False
_in_worker = False  # this process is a worker of imap_forked


def available_cores() -> int:
    """The cores this process may use (`taskset` narrows them), at most MEMPLAN_JOBS where that is set: how many
    traces run at once."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limit = os.environ.get("MEMPLAN_JOBS", "").strip()
    if not limit:
        return cores
    if not limit.isdigit() or int(limit) < 1:
        raise SettingsError(
            f"MEMPLAN_JOBS={limit!r}: give the most processes memplan may trace in at once, a whole number of at "
            "least 1, or unset it to use every core"
        )
    return min(cores, int(limit))


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
    if _others_running():
        _log.debug("tracing in one process: another thread of this program is running")
        return False
    global _fork_breaks_autograd
    if _fork_keeps_autograd:  # (cleared where a forked job found the handler armed: _note_fork_breaks_autograd)
        return True
    works = not _fork_breaks_autograd and _autograd_works_after_fork()
    if not works:
        _fork_breaks_autograd = True  # nothing mends it later in this process
        _log.debug(
            "planning in one process: autograd fails in a forked child of this process "
            "(a CUDA build of torch that sees a GPU, after a backward ran here)"
        )
        return False
    return True


_WORKS_WITHOUT_DEVICES, _WORKS = 0, 2  # the probe child's exit statuses (any other: autograd failed)


def _autograd_works_after_fork() -> bool:
    """Ask a forked child. Where torch has no device backend (_no_device_backend), the answer holds for the process
    (_fork_keeps_autograd): the engine arms its fork handler only as it starts device threads, which it does
    once and for no device at all (engine.cpp, start_device_threads returns before track_bad_autograd_forks
    when num_devices == 0), and the child is asked so that this process touches no device library itself."""
    global _fork_keeps_autograd
    pid = os.fork()
    if pid == 0:  # the child: nothing but the probe, then leave without running Python's exit code
        status = 1
        try:
            torch.ones(1, requires_grad=True).sum().backward()
            status = _WORKS
            if _no_device_backend():
                status = _WORKS_WITHOUT_DEVICES
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    _fork_keeps_autograd = code == _WORKS_WITHOUT_DEVICES
    return code in (_WORKS, _WORKS_WITHOUT_DEVICES)


def _no_device_backend() -> bool:
    """torch was built without CUDA or ROCm and sees no accelerator. A CUDA build on a machine without a GPU is not
    trusted so: under torch 2.11's CUDA build here, a forked child's backward failed after the test process had run
    its own, though a fresh process's did not (tests/test_forked.py, CI's torch 2.11 leg), so it is asked each time."""
    accelerator = getattr(torch, "accelerator", None)
    built_for_a_device = torch.version.cuda is not None or torch.version.hip is not None
    return not built_for_a_device and accelerator is not None and accelerator.device_count() == 0


def _note_fork_breaks_autograd(message: str) -> None:
    """A forked child's error that says autograd cannot run after fork (Engine's fork handler): no more forks."""
    global _fork_breaks_autograd, _fork_keeps_autograd
    if "autograd's threading" in message:
        _fork_breaks_autograd = True
        _fork_keeps_autograd = False  # (a device the probe's child did not see)
        _log.debug("tracing in one process from now on: autograd fails in a forked child of this process")


def _others_running() -> bool:
    """Whether another thread of the program is running: one that was importing a module as the process forked
    leaves that module's import lock held in the child, whose own import of it then waits forever (a compare's
    worker building the model hung so). Daemons too (a notebook's kernel threads import as they please); only
    library threads that wake to redraw or poll and import nothing a trace needs are let be (_IDLE_THREADS)."""
    here = threading.current_thread()
    return any(
        thread is not here
        and thread is not threading.main_thread()
        and thread.is_alive()
        and type(thread).__module__ not in _IDLE_THREADS
        for thread in threading.enumerate()
    )


# rich's refresh thread (the command line's progress spinner, rich.live._RefreshThread) and tqdm's monitor
# (tqdm._monitor.TMonitor, which transformers' progress bars start and leave running)
_IDLE_THREADS = ("rich.live", "tqdm._monitor")


def _die_with_parent() -> None:
    """Linux: the child is killed when the process that forked it ends (prctl PR_SET_PDEATHSIG), so a parent
    stopped by SIGTERM or SIGKILL leaves no trace running on; elsewhere nothing."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _start_worker() -> None:
    # A forked child keeps no threads but the one that forked: a lock another thread held at the
    # fork (the progress spinner writing to stderr) would stay held. Workers report nothing.
    _die_with_parent()
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the worker)
    # Intra-op threads are not fork-safe (OpenMP), as torch's DataLoader workers also assume.
    torch.set_num_threads(1)
    # As gc.freeze's documentation advises for fork without exec: the child's collections then skip
    # (and do not copy) everything inherited (timed once: a 48-block trace in a worker, -8%). Frozen in
    # the child, where the parent's own freeze (the CLI's, memplan.estimator.collector) stays as it was.
    freeze_existing_objects()
    global _in_worker
    _in_worker = True  # its cores are taken: a job here forks no children of its own (ForkedJob.can_start)


def _run(item: Any) -> Any:
    assert _job is not None
    return _job(item)


def imap_forked(
    job: Callable[[Any], Any], items: Sequence[Any], jobs: int, probed: bool = False
) -> Generator[Any, None, None]:
    """`job(item)` for each item, in order, from up to `jobs` forked workers (in this process when one is
    enough), each value as soon as it and those before it are done: a caller that stops early (Ctrl-C)
    keeps what came, and closing the iterator stops the workers.

    Items are handed out in order, one at a time: put the longest first. An exception a job
    raises is raised here. `probed`: the caller has just asked can_fork() itself.
    """
    workers = min(jobs, len(items))
    if workers <= 1 or _in_worker or not (probed or can_fork()):
        yield from (job(item) for item in items)
        return
    global _job
    _job = job
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker) as pool:
            yield from pool.imap(_run, items, chunksize=1)
    finally:
        _job = None


def side_by_side_workers(count: int) -> int:
    """How many forked workers run `count` independent jobs side by side: one per core, or 1 (in this process)
    where there is one job or one core, or forking cannot help (can_fork; imap_forked need not ask again)."""
    cores = available_cores()
    return cores if count > 1 and cores > 1 and can_fork() else 1


def map_forked(job: Callable[[Any], Any], items: Sequence[Any], jobs: int) -> list[Any]:
    """`[job(item) for item in items]`, in up to `jobs` forked workers (imap_forked)."""
    return list(imap_forked(job, items, jobs))


class ForkedJobFailed(Exception):
    """A ForkedJob's child raised, or died; the caller runs the job itself instead (not a MemplanError: the
    user never sees it)."""


class ForkedJob:
    """`job()` running in a forked child while this process goes on; `result()` waits for its value.

    Started only where it can help: the platform forks, a second core is free, and no child of this
    process has found autograd unusable after fork (can_fork's probe is not run: a child that finds it
    reports the error, the caller runs the job itself, and later jobs run in this process). The value
    comes back pickled through a pipe; the child leaves with os._exit, running none of this process's
    exit code.
    """

    @staticmethod
    def can_start() -> bool:
        # MEMPLAN_JOBS read first: a value that is no count is refused whether or not this process may fork now (it
        # went unread, and unrefused, once a child had found autograd unusable: CI's torch 2.11 leg, order-dependent)
        cores = available_cores()
        if _in_worker or _fork_breaks_autograd or _others_running():
            return False
        return "fork" in multiprocessing.get_all_start_methods() and cores > 1

    def __init__(self, job: Callable[[], Any]) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(read)
            status = 1
            try:
                _start_worker()
                try:
                    payload = ("value", job())
                except BaseException as error:  # noqa: BLE001 (reported to the parent, which runs the job itself)
                    payload = ("error", f"{type(error).__name__}: {error}")
                with os.fdopen(write, "wb") as pipe:
                    pipe.write(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        self._pid: int | None = pid
        self._read: int | None = read

    def result(self) -> Any:
        """The job's value, once the child has finished; ForkedJobFailed where it raised or died."""
        assert self._pid is not None and self._read is not None, "result() is read once"
        read, self._read = self._read, None  # the file object below closes it, however the read ends
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()  # a Ctrl-C here leaves the child to cancel()
        _, status = os.waitpid(self._pid, 0)
        self._pid = None
        if os.waitstatus_to_exitcode(status) != 0 or not data:
            raise ForkedJobFailed(f"the forked child exited with status {os.waitstatus_to_exitcode(status)}")
        kind, value = pickle.loads(data)
        if kind == "error":
            _note_fork_breaks_autograd(value)
            raise ForkedJobFailed(value)
        return value

    def cancel(self) -> None:
        """Stop the child if it still runs (the caller no longer needs its value)."""
        if self._pid is None:
            return
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self._pid, 0)
        if self._read is not None:
            os.close(self._read)
            self._read = None
        self._pid = None
