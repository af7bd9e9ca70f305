"""Planning's independent traces in forked workers: same answers as one process, in order, errors raised here."""

import json
import logging
import os

import pytest
import torch

from memplan.errors import TraceError
from memplan.models.source import resolve_model
from memplan.planner import forked
from memplan.planner.forked import map_forked
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
    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIGS["gpt2"], "n_layer": 6}))
    spec = resolve_model(str(tmp_path))
    settings = spec.settings_for(TrainingSettings(batch_size=4, seq_len=64, device="cpu"))
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
    with caplog.at_level(logging.DEBUG, logger="memplan"):
        results = map_forked(_pid_and_square, [1, 2, 3], jobs=2)
    assert results == [(os.getpid(), 1), (os.getpid(), 4), (os.getpid(), 9)]
    assert "autograd fails in a forked child" in caplog.text
