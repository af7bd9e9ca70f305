"""Ctrl-C during work that torch's C++ calls back into is held until a point where it can propagate."""

from __future__ import annotations

import os
import signal

import pytest

from memplan import interrupts


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # delivered to this (main) thread before os.kill returns


def test_ctrl_c_inside_a_deferred_block_is_raised_where_the_block_ends() -> None:
    reached: list[str] = []
    with interrupts.reliable_interrupts():
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred():
                _ctrl_c()
                reached.append("after the signal")  # the handler did not raise inside the block
                with interrupts.deferred():  # nested: the inner end is the first safe point
                    reached.append("inner")
                reached.append("not reached")
        assert interrupts.requested
    assert reached == ["after the signal", "inner"]
    assert not interrupts.requested  # the next command starts clean


def test_a_second_ctrl_c_inside_a_deferred_block_raises_at_once() -> None:
    reached: list[str] = []
    with interrupts.reliable_interrupts():
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred():
                _ctrl_c()
                reached.append("after the first")
                _ctrl_c()
                reached.append("after the second")
    assert reached == ["after the first"]


def test_ctrl_c_outside_a_deferred_block_raises_at_once() -> None:
    reached: list[str] = []
    with interrupts.reliable_interrupts():
        with pytest.raises(KeyboardInterrupt):
            _ctrl_c()
            reached.append("not reached")
    assert reached == []


def test_a_deferred_block_that_fails_keeps_its_own_error() -> None:
    with interrupts.reliable_interrupts():
        with pytest.raises(ValueError, match="the block's own"):
            with interrupts.deferred():
                _ctrl_c()
                raise ValueError("the block's own error")
        assert interrupts.seen  # the CLI reports what follows an interrupt as the interrupt


def test_the_recorder_raises_a_held_ctrl_c_at_the_next_op_it_records() -> None:
    import torch

    from memplan.estimator.recorder import GraphRecorder

    ops_after_the_signal: list[str] = []
    with interrupts.reliable_interrupts():
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred(), GraphRecorder([]):
                torch.ones(2) + 1  # recorded
                _ctrl_c()
                ops_after_the_signal.append("python code still runs")
                torch.ones(2) * 2  # raised here, at the dispatch
                ops_after_the_signal.append("not reached")
    assert ops_after_the_signal == ["python code still runs"]
