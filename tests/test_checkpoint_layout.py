"""A checkpoint layout: its checks, its one-line description and its round trip through a plan file
(memplan.checkpoint_layout). Where a layout meets a real model: tests/test_checkpointing.py."""

import json

import pytest

from memplan.checkpoint_layout import CheckpointLayout
from memplan.errors import SettingsError

THREE_SEGMENTS = CheckpointLayout(segments=(("h.0",), ("h.1", "h.2"), ("h.3",)), policies=("selective", "full", "full"))


def test_policies_left_out_are_full_ones():
    assert CheckpointLayout(segments=(("h.0",), ("h.1",))).policies == ("full", "full")
    assert CheckpointLayout().policies == ()


@pytest.mark.parametrize(
    ("layout", "described"),
    [
        (THREE_SEGMENTS, "3 checkpoint(s) over 4 module(s) (1 selective)"),
        (CheckpointLayout(segments=(("h.0", "h.1"),)), "1 checkpoint(s) over 2 module(s)"),
        (
            CheckpointLayout(segments=(("h.0",), ("h.1",)), policies=("selective",) * 2),
            "2 checkpoint(s) over 2 module(s) (selective)",
        ),
        (
            CheckpointLayout(segments=(("h.0",), ("h.1",), ("h.2",)), policies=("selective", "selective", "full")),
            "3 checkpoint(s) over 3 module(s) (2 selective)",
        ),
        (CheckpointLayout(), "0 checkpoint(s) over 0 module(s)"),
    ],
)
def test_a_layout_describes_its_segments_modules_and_selective_ones(layout, described):
    assert layout.describe() == described


def test_a_layout_survives_a_plan_file():
    written = json.loads(json.dumps(THREE_SEGMENTS.to_dict()))
    assert written == {"segments": [["h.0"], ["h.1", "h.2"], ["h.3"]], "policies": ["selective", "full", "full"]}
    assert CheckpointLayout.from_dict(written) == THREE_SEGMENTS
    # A plan written before policies existed, and one with no checkpoint at all.
    assert CheckpointLayout.from_dict({"segments": [["h.0"]]}) == CheckpointLayout(
        segments=(("h.0",),), policies=("full",)
    )
    assert CheckpointLayout.from_dict({}) == CheckpointLayout()


@pytest.mark.parametrize(
    ("segments", "policies", "message"),
    [
        ((("h.0",), ("h.1",)), ("full",), "one policy per segment: 2 segment(s), 1 policies"),
        ((("h.0",),), ("partial",), "checkpoint policy"),
        ((("h.0",), ()), (), "a checkpoint segment must name at least one module"),
        ((("h.1",), ("h.0", "h.1"), ("h.0",)), (), "modules checkpointed twice in one layout: h.0, h.1"),
        # the wrong types, as a hand-edited plan file or a Python caller gives them
        (
            ("h.0",),
            (),
            "segments are lists of module names, e.g. (('transformer.h.0', 'transformer.h.1'),); got ('h.0',)",
        ),
        (((0,),), (), "segments are lists of module names"),
        ("h.0", (), "segments are lists of module names"),
        ((("h.0",),), "full", "policies are a list, one of full, selective per segment; got 'full'"),
        ((("h.0",),), (None,), "policies are a list"),
    ],
)
def test_a_malformed_layout_is_refused_with_its_reason(segments, policies, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CheckpointLayout(segments=segments, policies=policies)


def test_lists_are_taken_as_tuples_and_a_layout_that_is_no_object_is_refused():
    assert CheckpointLayout(segments=[["h.0", "h.1"]], policies=["selective"]) == CheckpointLayout(
        segments=(("h.0", "h.1"),), policies=("selective",)
    )
    with pytest.raises(
        SettingsError, match="a checkpoint layout is an object with 'segments' and 'policies'; got None"
    ):
        CheckpointLayout.from_dict(None)
