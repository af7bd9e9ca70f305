"""memplan.profiled_allocations: what the CPU allocator gave out while a call ran (the validator's counter and the
oneDNN LSTM probe read kernels' own temporaries so)."""

import pytest
import torch

from memplan.profiled_allocations import allocations_recorded, profiled_call, profiler_running
from tests.hand_measure import allocator_events, window


def test_the_peak_and_what_the_call_returned_are_read_off_the_allocator():
    result, peak, end = profiled_call(lambda: torch.ones(1000).neg())  # a 4,000 B temporary beside the 4,000 B result
    assert (peak, end) == (8000, 4000) and result.numel() == 1000


def test_the_profiler_s_own_lines_are_not_printed(capfd):
    """torch 2.13's profiler writes "USDT: ... profiler_start" / "profiler_stop" to the process's stderr from C++: an
    estimate of an LSTM printed 12 such lines, one pair per layer probed (a review found)."""
    profiled_call(lambda: torch.ones(3))
    assert "profiler_st" not in capfd.readouterr().err


def _step() -> None:
    """A small training step with a record_function window around its backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    loss = model(torch.randn(16, 32)).square().mean()
    with torch.profiler.record_function("backward"):
        loss.backward()


def _lstm_step() -> None:
    """A oneDNN LSTM's step (the layers memplan's rule probes with the recorder: memplan.estimator.oprules.rnn), its
    backward in a record_function window."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(16, 24, num_layers=2, batch_first=True)
    with torch.backends.mkldnn.flags(enabled=True):
        out, _ = lstm(torch.randn(3, 7, 16))
        with torch.profiler.record_function("backward"):
            out.square().mean().backward()


@pytest.mark.parametrize("step", [_step, _lstm_step], ids=["mlp", "onednn-lstm"])
def test_the_recording_has_the_allocator_events_torch_s_profiler_has_and_no_op_events(step):
    """The truth is torch's own profiler run as the tests ran it before 2026-12-07 (every op recorded): the same
    allocations and frees in the same order, the same window; the ops themselves are what the recording leaves out."""
    from torch.profiler import ProfilerActivity, profile

    step()  # (what a first run makes once: oneDNN's primitives)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    with allocations_recorded() as recording:
        assert profiler_running()
        step()
    assert not profiler_running()
    torch_s = [event.nbytes() for event in allocator_events(profiler)]
    assert [event.nbytes() for event in recording.allocator_events()] == torch_s and len(torch_s) > 20
    inside = {}
    for name, run in (("memplan's", recording), ("torch's", profiler)):
        start, end = window(run, "backward")
        inside[name] = [event.nbytes() for event in allocator_events(run) if start <= event.start_ns() <= end]
    assert inside["memplan's"] == inside["torch's"] and inside["torch's"]
    assert any(e.name().startswith("aten::") for e in profiler.profiler.kineto_results.events())
    assert not any(e.name().startswith("aten::") for e in recording.kineto_results.events())


def test_inside_a_running_profiler_it_refuses_and_that_profiler_keeps_its_events():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as session:
        before = torch.ones(1000)
        with pytest.raises(RuntimeError, match="profilers cannot nest"):
            with allocations_recorded():
                pass
        assert profiler_running()
        after = torch.ones(1000)
    allocated = [event.nbytes() for event in session.profiler.kineto_results.events() if event.name() == "[memory]"]
    assert allocated == [before.untyped_storage().nbytes(), after.untyped_storage().nbytes()]


def test_a_failure_to_stop_leaves_no_profiler_said_running(monkeypatch):
    from torch._C import _autograd

    stop = _autograd._disable_profiler

    def failing() -> None:
        stop()  # (stopped for real, so that later tests may profile)
        raise RuntimeError("stopping failed")

    monkeypatch.setattr(_autograd, "_disable_profiler", failing)
    with pytest.raises(RuntimeError, match="stopping failed"):
        with allocations_recorded():
            torch.ones(10)
    assert not profiler_running()
