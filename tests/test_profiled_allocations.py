"""memplan.profiled_allocations: what the CPU allocator gave out while a call ran (the validator's counter and the
oneDNN LSTM probe read kernels' own temporaries so)."""

import torch

from memplan.profiled_allocations import profiled_call


def test_the_peak_and_what_the_call_returned_are_read_off_the_allocator():
    result, peak, end = profiled_call(lambda: torch.ones(1000).neg())  # a 4,000 B temporary beside the 4,000 B result
    assert (peak, end) == (8000, 4000) and result.numel() == 1000


def test_the_profiler_s_own_lines_are_not_printed(capfd):
    """torch 2.13's profiler writes "USDT: ... profiler_start" / "profiler_stop" to the process's stderr from C++: an
    estimate of an LSTM printed 12 such lines, one pair per layer probed (a review found)."""
    profiled_call(lambda: torch.ones(3))
    assert "profiler_st" not in capfd.readouterr().err
