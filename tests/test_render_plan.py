"""How a plan's layout is named in the text output (memplan.render.plan)."""

from memplan.checkpoint_layout import CheckpointLayout
from memplan.render.plan import describe_layout


def test_a_layout_names_its_segments_and_the_selective_ones():
    layout = CheckpointLayout(segments=(("h.0",), ("h.1", "h.2")), policies=("selective", "full"))
    assert describe_layout(layout) == "h.0 (selective), h.1 … h.2 (one segment)"
    assert describe_layout(CheckpointLayout()) == "no checkpointing"
