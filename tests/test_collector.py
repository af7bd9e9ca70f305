"""memplan.estimator.collector: a library call keeps Python's collector off what the process held before it,
and leaves the process's own frozen objects as they were."""

from __future__ import annotations

import gc

import pytest

import memplan
from memplan.estimator.collector import existing_objects_frozen, freeze_existing_objects, unfreeze_objects


@pytest.fixture
def nothing_frozen():
    """The process with nothing frozen (a command-line test in the same worker froze what it held), and
    frozen again after, so the worker's later tests run as they would have."""
    was_frozen = gc.get_freeze_count()
    unfreeze_objects()
    yield
    if was_frozen:
        freeze_existing_objects()


def _seen(target: object) -> bool:
    return any(obj is target for obj in gc.get_objects())


def test_what_exists_is_frozen_meanwhile_and_given_back(nothing_frozen):
    before = [1]  # a container: the collector tracks it
    with existing_objects_frozen():
        assert gc.get_freeze_count() > 0
        made_meanwhile = [2]
        assert _seen(made_meanwhile) and not _seen(before)
    assert gc.get_freeze_count() == 0 and _seen(before)


def test_a_process_that_froze_its_own_is_left_as_it_was(nothing_frozen):
    gc.freeze()
    frozen = gc.get_freeze_count()
    with existing_objects_frozen():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen


def test_an_estimate_runs_with_what_existed_frozen_and_leaves_nothing_frozen(nothing_frozen):
    frozen_while_running = []
    memplan.estimate(
        "tests.two_layer_mlp:two_layer",
        inputs="tests.two_layer_mlp:rows",
        loss="tests.two_layer_mlp:mean_square",
        batch_size=4,
        device="cpu",
        progress=lambda message: frozen_while_running.append(gc.get_freeze_count()),
    )
    assert frozen_while_running and all(frozen_while_running)
    assert gc.get_freeze_count() == 0


def test_where_memplan_froze_the_objects_itself_a_call_does_not_count_them(nothing_frozen, monkeypatch):
    """gc.get_freeze_count() walks every frozen object (0.1 s in a test worker, 35 ms after the command line's
    imports), and every library call asked it: where memplan froze them (the command line, a forked worker,
    the validator's worker) it knows without asking, and leaves them frozen."""
    before = [1]
    freeze_existing_objects()

    def counted() -> int:
        raise AssertionError("gc.get_freeze_count() called where memplan froze the objects itself")

    monkeypatch.setattr(gc, "get_freeze_count", counted)
    with existing_objects_frozen():
        made_meanwhile = [2]
        assert _seen(made_meanwhile) and not _seen(before)
    assert not _seen(before)  # still frozen: the freeze was not the block's to undo
