"""Planning's independent traces in forked workers: same answers as one process, in order, errors raised here."""

import json
import logging
import os

import pytest
import torch

from memplan import forked
from memplan.errors import TraceError
from memplan.forked import map_forked
from memplan.models.source import resolve_model
from memplan.planner.plan import make_plan
from memplan.settings import TrainingSettings
from tests.zoo import TINY_HF_CONFIGS

needs_fork = pytest.mark.skipif(
    "fork" not in __import__("multiprocessing").get_all_start_methods(), reason="this platform cannot fork"
)


def _pid_and_square(number: int) -> tuple[int, int]:
    return os.getpid(), number * number


def _fail_on_three(number: int) -> int:
    if number == 3:
        raise TraceError(f"cannot trace item {number}")
    return number


@needs_fork
def test_results_come_back_in_order_from_other_processes():
    if not forked.can_fork():
        # A CUDA build arms autograd's fork handler once it has touched CUDA (fake CUDA tensors in
        # other tests count): a real limitation of that build, covered by the fallback tests below.
        pytest.skip("autograd cannot run in a forked child of this process (torch's fork handler is armed)")
    results = map_forked(_pid_and_square, list(range(6)), jobs=2)
    assert [square for _, square in results] == [n * n for n in range(6)]
    assert os.getpid() not in {pid for pid, _ in results}


def test_one_job_runs_here():
    results = map_forked(_pid_and_square, [1, 2, 3], jobs=1)
    assert results == [(os.getpid(), 1), (os.getpid(), 4), (os.getpid(), 9)]


@needs_fork
def test_a_workers_error_is_raised_here():
    with pytest.raises(TraceError, match="cannot trace item 3"):
        map_forked(_fail_on_three, [1, 2, 3, 4], jobs=2)


@needs_fork
def test_plan_in_workers_equals_plan_in_one_process(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIGS["gpt2"], "n_layer": 4}))
    spec = resolve_model(str(tmp_path))
    settings = spec.settings_for(TrainingSettings(batch_size=4, seq_len=32, device="cpu"))
    wide = make_plan(spec, settings, 1 << 40, jobs=1)
    peaks = {option.name: option.predicted_peak_bytes for option in wide.baselines}
    budget = (peaks["all blocks"] + peaks["none"]) // 2
    alone, forked = make_plan(spec, settings, budget, jobs=1), make_plan(spec, settings, budget, jobs=2)
    assert forked.layout == alone.layout and forked.layout.segments
    assert forked.predicted_peak_bytes == alone.predicted_peak_bytes
    assert forked.recompute_flops == alone.recompute_flops
    assert [option.to_dict() for option in forked.baselines] == [option.to_dict() for option in alone.baselines]
    assert forked.traces == alone.traces


def _gradient_sum(size: int) -> int:
    leaf = torch.ones(size, requires_grad=True)
    (leaf * 2).sum().backward()  # every trace runs the autograd engine
    return int(leaf.grad.sum())


@needs_fork
def test_jobs_that_run_autograd_work_after_a_backward_here():
    # What planning does: the base trace's backward runs here before the workers fork. On CUDA
    # builds of torch a forked child's backward then fails; the work must still come back right.
    torch.ones(1, requires_grad=True).sum().backward()
    assert map_forked(_gradient_sum, [1, 2, 3], jobs=2) == [2, 4, 6]


@needs_fork
def test_when_autograd_cannot_run_in_a_fork_the_jobs_run_here_and_debug_says_why(monkeypatch, caplog):
    monkeypatch.setattr(forked, "_autograd_works_after_fork", lambda: False)
    monkeypatch.setattr(forked, "_fork_breaks_autograd", False)
    monkeypatch.setattr(forked, "_fork_keeps_autograd", False)
    with caplog.at_level(logging.DEBUG, logger="memplan"):
        results = map_forked(_pid_and_square, [1, 2, 3], jobs=2)
    assert results == [(os.getpid(), 1), (os.getpid(), 4), (os.getpid(), 9)]
    assert "autograd fails in a forked child" in caplog.text


@needs_fork
@pytest.mark.skipif(not forked._no_device_backend(), reason="a build for a device: the probe's answer is not kept")
def test_without_a_device_one_probe_answers_for_the_process(monkeypatch):
    """The probe forks a child (0.05 s after a gpt2 estimate here, 0.14 s in a pytest worker); where torch has no
    device backend autograd never starts the threads that break it in a child, so plan, compare and sweep ask once a
    process (a CUDA build is asked each time: forked._no_device_backend)."""
    monkeypatch.setattr(forked, "_fork_breaks_autograd", False)
    monkeypatch.setattr(forked, "_fork_keeps_autograd", False)
    forks = []
    real_fork = os.fork

    def counted_fork() -> int:
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", counted_fork)
    assert forked.can_fork() and forked.can_fork() and forked.can_fork()
    assert len(forks) == 1
    # a child that sees a device answers for itself only (the patch carries into the forked child)
    monkeypatch.setattr(forked, "_fork_keeps_autograd", False)
    monkeypatch.setattr(forked, "_no_device_backend", lambda: False)
    assert forked.can_fork() and forked.can_fork() and forked.can_fork()
    assert len(forks) == 4
    # a forked job that found autograd's fork handler armed overrules an earlier probe's answer
    monkeypatch.setattr(forked, "_no_device_backend", lambda: True)
    assert forked.can_fork() and forked._fork_keeps_autograd
    forked._note_fork_breaks_autograd("Unable to handle autograd's threading in combination with fork-based ...")
    assert not forked.can_fork()


# An estimate's second trace (the per-sample slope's batch size) in a forked child: ForkedJob.


@needs_fork
def test_a_forked_job_runs_in_another_process_and_hands_back_its_value():
    pid, value = forked.ForkedJob(lambda: (os.getpid(), {"bytes": 7 << 30})).result()
    assert pid != os.getpid() and value == {"bytes": 7 << 30}


@needs_fork
def test_a_forked_jobs_error_fails_the_job_and_autograd_s_says_no_more_forks(monkeypatch):
    monkeypatch.setattr(forked, "_fork_breaks_autograd", False)
    with pytest.raises(forked.ForkedJobFailed, match="ZeroDivisionError"):
        forked.ForkedJob(lambda: 1 // 0).result()
    assert not forked._fork_breaks_autograd  # an error of the job's own leaves forking alone

    def engine_refuses() -> None:
        raise RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing")

    with pytest.raises(forked.ForkedJobFailed, match="autograd's threading"):
        forked.ForkedJob(engine_refuses).result()
    assert not forked.ForkedJob.can_start()


@needs_fork
def test_a_cancelled_job_s_child_is_gone():
    job = forked.ForkedJob(lambda: __import__("time").sleep(60))
    pid = job._pid
    job.cancel()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    job.cancel()  # twice is nothing


def _estimate_both_ways(monkeypatch, model: str, **settings) -> tuple[dict, dict, int]:
    import memplan

    return _both_ways(monkeypatch, lambda: memplan.estimate(model, **settings))


def _both_ways(monkeypatch, run) -> tuple[dict, dict, int]:
    """`run()`'s result with forked traces beside this process's, and with none; how many were forked."""
    started = []
    real_job = forked.ForkedJob

    class CountedJob(real_job):
        def __init__(self, job):
            started.append(1)
            super().__init__(job)

    monkeypatch.setattr("memplan.estimator.batch_tracer.ForkedJob", CountedJob)
    aside = run().to_dict()
    monkeypatch.setattr(CountedJob, "can_start", staticmethod(lambda: False))
    here = run().to_dict()
    for result in (aside, here):
        result.pop("seconds")
    return aside, here, len(started)


@needs_fork
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_estimate_s_slope_traced_in_a_forked_child_is_the_one_traced_here(monkeypatch, device):
    monkeypatch.setenv("MEMPLAN_JOBS", "2")
    if not forked.ForkedJob.can_start():
        pytest.skip("no second core, or autograd cannot run in a forked child of this process")
    aside, here, forks = _estimate_both_ways(monkeypatch, "tiny-gpt2", batch_size=6, seq_len=64, device=device)
    assert forks == 1 and aside["traces"] == here["traces"] == 2
    assert aside == here


@needs_fork
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_sweep_s_traced_points_in_forked_children_are_those_traced_here(monkeypatch, device):
    """One series: batch 1 here with 8 beside it, then 2 here with 4 beside it (forked after the first trace, so
    replaying its optimizer step); the lines through them answer 3 and 6."""
    import memplan

    monkeypatch.setenv("MEMPLAN_JOBS", "2")
    if not forked.ForkedJob.can_start():
        pytest.skip("no second core, or autograd cannot run in a forked child of this process")
    sizes = (1, 2, 3, 4, 6, 8)
    aside, here, forks = _both_ways(
        monkeypatch, lambda: memplan.sweep("tiny-gpt2", batch_sizes=sizes, seq_len=64, device=device, budget="1GiB")
    )
    assert forks == 2 and aside == here
    (series,) = aside["series"]
    assert series["traces"] == 4 and [p["traced"] for p in series["points"]] == [1, 1, 0, 1, 0, 1]


@needs_fork
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_budget_s_lines_confirmed_by_a_third_forked_trace_give_the_answers_traced_here(monkeypatch, device):
    """With a third core, a budget's estimate traces twice its batch size in a second child beside the first two
    traces, only to confirm the lines through them: the search then traces nothing after them, and every answer is
    the one the estimate gives tracing the search's guesses here (batch_tracer.BatchTracer.confirm_aside)."""
    monkeypatch.setenv("MEMPLAN_JOBS", "2")  # conftest gives pytest-xdist's workers 1
    monkeypatch.setattr("memplan.estimator.batch_tracer.available_cores", lambda: 3)
    if not forked.ForkedJob.can_start():
        pytest.skip("no second core, or autograd cannot run in a forked child of this process")
    budget = {"cpu": "40MiB", "cuda": "1GiB"}[device]
    aside, here, forks = _estimate_both_ways(
        monkeypatch, "tiny-gpt2", batch_size=6, seq_len=64, device=device, budget=budget
    )
    assert forks == 2 and aside["traces"] == here["traces"] == 3  # 6, 3 and 12 beside; 6, 3 and a guess here
    assert aside["interpolated_batch_sizes"] > here["interpolated_batch_sizes"]  # the guess too, from the lines
    assert aside["max_batch_size"] > 6  # a search that guessed above the batch size
    for result in (aside, here):
        result.pop("interpolated_batch_sizes")
    assert aside == here


@needs_fork
def test_a_slope_that_cannot_be_traced_at_half_the_batch_is_traced_at_twice_after_a_forked_failure(monkeypatch):
    """Batch 2's slope runs at 1, where BatchNorm in training fails: the child reports it, and the estimate
    goes on as it does in one process (twice the batch)."""
    monkeypatch.setenv("MEMPLAN_JOBS", "2")
    if not forked.ForkedJob.can_start():
        pytest.skip("no second core, or autograd cannot run in a forked child of this process")
    models = {
        "inputs": "tests.zoo_models:flat_inputs",
        "loss": "tests.zoo_models:mean_square_loss",
        "batch_size": 2,
        "device": "cpu",
    }
    aside, here, forks = _estimate_both_ways(monkeypatch, "tests.zoo_models:batch_norm_mlp", **models)
    assert forks == 1 and aside == here
    assert aside["per_sample_activation_bytes"] > 0


@needs_fork
def test_an_iterator_closed_early_keeps_what_came_and_stops_its_workers():
    if not forked.can_fork():
        pytest.skip("autograd cannot run in a forked child of this process (torch's fork handler is armed)")
    values = forked.imap_forked(_pid_and_square, list(range(8)), jobs=2)
    came = [next(values), next(values)]
    values.close()
    assert [square for _, square in came] == [0, 1]
    assert not __import__("multiprocessing").active_children()


@needs_fork
def test_a_job_whose_wait_was_interrupted_is_cancelled_cleanly(monkeypatch):
    """Ctrl-C while the parent reads the child's value: the read's file is closed by then, and cancel() (the
    estimate's `finally`) stops the child without closing it again."""
    job = forked.ForkedJob(lambda: __import__("time").sleep(60))
    pid = job._pid

    real_fdopen = os.fdopen

    class InterruptedRead:
        def __init__(self, descriptor: int, mode: str) -> None:
            self.file = real_fdopen(descriptor, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exception) -> None:
            self.file.close()

        def read(self) -> bytes:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "fdopen", InterruptedRead)
    with pytest.raises(KeyboardInterrupt):
        job.result()
    monkeypatch.undo()
    job.cancel()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_memplan_jobs_caps_the_cores_memplan_uses(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("MEMPLAN_JOBS", "1")
    assert forked.available_cores() == 1 and not forked.ForkedJob.can_start()
    monkeypatch.setenv("MEMPLAN_JOBS", "64")
    assert forked.available_cores() == cores
    monkeypatch.delenv("MEMPLAN_JOBS")
    assert forked.available_cores() == cores  # what is no number is refused (test below)


@needs_fork
def test_compare_rows_and_sweep_series_side_by_side_are_those_traced_one_by_one(monkeypatch):
    import memplan

    if not forked.can_fork():
        pytest.skip("autograd cannot run in a forked child of this process (torch's fork handler is armed)")
    common = {"seq_len": 32, "device": "cpu"}
    results, forked_messages = {}, {}
    for jobs in ("2", "1"):
        monkeypatch.setenv("MEMPLAN_JOBS", jobs)
        said: list[str] = []
        compared = memplan.compare("tiny-gpt2", batch_size=4, progress=said.append, **common).to_dict()
        swept = memplan.sweep(
            "tiny-gpt2", batch_sizes=(1, 2, 4), precisions=("fp32", "bf16"), progress=said.append, **common
        ).to_dict()
        for result in (compared, swept):
            result.pop("seconds")
        results[jobs] = (compared, swept)
        forked_messages[jobs] = sum("tracing in a forked process" in message for message in said)
    assert len(results["2"][0]["rows"]) > 5 and len(results["2"][1]["series"]) == 2
    # side by side with two cores (each row and series said so), one by one with one
    assert forked_messages["2"] == len(results["2"][0]["rows"]) + 2 and forked_messages["1"] == 0
    assert results["2"] == results["1"]


def test_no_fork_while_another_thread_of_the_program_runs(monkeypatch):
    """A thread importing a module as the process forks leaves its import lock held in the child, whose own
    import of the module then waits forever: memplan traces in one process while such a thread runs."""
    import threading

    monkeypatch.setenv("MEMPLAN_JOBS", "2")
    # (the threads' rule alone: an earlier test's child may have found autograd unusable after fork in this process,
    # as on torch 2.11's CUDA build after a plan's trace, which rules forking out for the rest of the process)
    monkeypatch.setattr(forked, "_fork_breaks_autograd", False)
    release = threading.Event()
    worker = threading.Thread(target=release.wait)
    worker.start()
    try:
        assert not forked.ForkedJob.can_start() and not forked.can_fork()
    finally:
        release.set()
        worker.join()
    daemon = threading.Thread(target=release.wait, daemon=True)  # a notebook kernel's, say
    release.clear()
    daemon.start()
    try:
        assert not forked.ForkedJob.can_start()
    finally:
        release.set()
        daemon.join()
    if "fork" in __import__("multiprocessing").get_all_start_methods():
        from rich.console import Console

        with Console(stderr=True).status("tracing"):  # the command line's spinner: its thread is let be
            assert forked.ForkedJob.can_start()


@needs_fork
def test_a_forked_child_ends_with_the_process_that_forked_it(tmp_path):
    """SIGTERM or SIGKILL to memplan leaves no trace running on (PR_SET_PDEATHSIG in the child)."""
    import subprocess
    import sys
    import time

    script = (
        "import os, sys, time\n"
        "from memplan import forked\n"
        "job = forked.ForkedJob(lambda: time.sleep(60))\n"
        "print(job._pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.5)  # the child has asked for its death signal
    parent.kill()
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, 9)
    raise AssertionError("the forked child outlived its parent")


@pytest.mark.parametrize("limit", ["abc", "0", "-1", "1.5"])
def test_a_jobs_limit_that_is_no_count_of_processes_is_a_one_line_usage_error(monkeypatch, limit):
    """MEMPLAN_JOBS=abc was ignored without a word (every core used), 0 read as 1 (a CLI bug hunt, M5)."""
    from click.testing import CliRunner

    from memplan.cli import main

    monkeypatch.setenv("MEMPLAN_JOBS", limit)
    monkeypatch.setattr(forked, "_fork_breaks_autograd", True)  # refused even where this process may not fork
    result = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "-b", "2", "--seq-len", "8", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"memplan: error: MEMPLAN_JOBS='{limit}': ") and result.stderr.count("\n") == 1
    monkeypatch.setenv("MEMPLAN_JOBS", " 1 ")
    assert forked.available_cores() == 1
