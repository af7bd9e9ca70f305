"""--plot and --snapshot, read back: the PNG's size and colours, memory_viz's own readers on the pickle."""

import base64
import pickle
import re
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
from click.testing import CliRunner

from memplan.api import estimate
from memplan.cli import main
from memplan.render.plot import CATEGORY_COLOURS, plot_timeline
from memplan.render.snapshot import predicted_snapshot

SETTINGS = {"batch_size": 2, "seq_len": 64, "precision": "amp-bf16"}


@pytest.fixture(scope="module")
def result():
    return estimate("tiny-gpt2", **SETTINGS)


def test_timeline_totals_reproduce_the_peak_and_breakdown(result):
    timeline = result.timeline
    per_category = timeline.category_bytes()
    totals = timeline.total_bytes()
    assert len(totals) == result.graph_nodes
    assert max(totals) == result.peak_bytes
    peak_node = totals.index(max(totals))
    assert {key: values[peak_node] for key, values in per_category.items()} == result.breakdown.to_dict()


def _colours(path):
    pixels = (matplotlib.image.imread(path)[..., :3] * 255).round().astype(np.uint8)
    return pixels.shape, {tuple(int(c) for c in pixel) for pixel in pixels.reshape(-1, 3)}


def _rgb(hex_colour):
    return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))


def test_plot_png_has_its_size_every_category_and_the_budget_line(result, tmp_path):
    path = tmp_path / "memory.png"
    plot_timeline(result.timeline, path, title="tiny-gpt2", budget_bytes=result.peak_bytes + (1 << 20))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shape, colours = _colours(path)
    assert shape == (660, 1440, 3)  # figsize (12, 5.5) inches at 120 dpi
    present = [key for key, value in result.timeline.category_bytes().items() if any(value)]
    assert {"parameters", "gradients", "optimizer_state", "activations", "workspaces"} <= set(present)
    for key in present:
        assert _rgb(CATEGORY_COLOURS[key]) in colours, key
    assert (255, 0, 0) in colours  # the budget line


def test_plot_without_budget_draws_no_budget_line(result, tmp_path):
    path = tmp_path / "memory.png"
    plot_timeline(result.timeline, path, title="tiny-gpt2")
    assert (255, 0, 0) not in _colours(path)[1]


def test_snapshot_replays_to_the_predicted_peaks(result):
    snapshot = predicted_snapshot(result.timeline)
    segments = snapshot["segments"]
    assert sum(segment["total_size"] for segment in segments) == result.reserved_peak_bytes
    # Blocks tile their segment, and what is still allocated after the iteration is what persists.
    for segment in segments:
        assert sum(block["size"] for block in segment["blocks"]) == segment["total_size"]
    persistent = sum(
        block["requested_size"] for segment in segments for block in segment["blocks"] if block["state"] != "inactive"
    )
    live, peak = persistent, persistent
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live += event["size"]
        elif event["action"] == "free_completed":
            live -= event["size"]
        peak = max(peak, live)
    assert live == persistent  # every allocation of the iteration is freed within it
    assert peak == result.peak_bytes
    actions = {event["action"] for event in snapshot["device_traces"][0]}
    assert actions == {"alloc", "free_requested", "free_completed"}  # steady state: no new segments


def test_memory_viz_reads_the_snapshot(result, tmp_path):
    from torch.cuda import _memory_viz

    snapshot = predicted_snapshot(result.timeline)
    summary = _memory_viz.segsum(snapshot)  # asserts its own byte accounting
    assert f"segments: {len(snapshot['segments'])}" in summary
    path, page = tmp_path / "predicted.pickle", tmp_path / "page.html"
    path.write_bytes(pickle.dumps(snapshot))
    subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(page)],
        check=True,
        capture_output=True,
    )
    html = page.read_text()
    assert "Active Memory Timeline" in html
    embedded = re.search(r'"base64": "([^"]+)"', html).group(1)
    assert pickle.loads(base64.b64decode(embedded).rstrip(b"\x00")) == snapshot


def test_cli_writes_both_files_and_refuses_bad_ones(tmp_path):
    plot, snapshot = tmp_path / "m.png", tmp_path / "m.pickle"
    args = ["estimate", "tiny-gpt2", "-b", "2", "--seq-len", "64", "--json"]
    result = CliRunner().invoke(main, [*args, "--plot", str(plot), "--snapshot", str(snapshot)])
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert pickle.loads(snapshot.read_bytes())["memplan"]["peak_bytes"] > 0
    cpu = CliRunner().invoke(main, [*args, "--device", "cpu", "--snapshot", str(snapshot)])
    assert cpu.exit_code == 2 and "use it with --device cuda" in cpu.output
    missing = CliRunner().invoke(main, [*args, "--plot", str(tmp_path / "no" / "m.png")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_plot_names_a_file_type_matplotlib_writes(tmp_path):
    result = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "--plot", str(tmp_path / "memory.txt")])
    assert result.exit_code == 2 and "name a .png, .svg, .pdf file" in result.output


def test_a_one_op_spike_is_drawn_as_a_line_with_a_marker_on_it(tmp_path, monkeypatch):
    """A spike one node wide in 20,000 is narrower than a pixel of the stacked areas: the total is
    drawn as a line too, and a marker sits on the peak (issue 17: the plot hid a one-op peak)."""
    import memplan.render.plot as plot_module
    from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation

    plateau = TimelineAllocation(0, 20_000, 1 << 30, "parameters", "p", None)
    spike = TimelineAllocation(10_000, 10_000, 1 << 30, "temporaries", "t", None)
    timeline = MemoryTimeline(20_000, 8_000, 16_000, (plateau, spike))
    captured = []
    monkeypatch.setattr(plot_module, "_save", lambda figure, path: captured.append(figure))
    plot_timeline(timeline, tmp_path / "spike.png", title="spike")
    axes = captured[0].axes[0]
    heights = [max(line.get_ydata(), default=0) for line in axes.lines]
    marker = [line for line in axes.lines if line.get_marker() == "v"]
    assert max(heights) == 2.0  # GiB: the line reaches the spike
    assert len(marker) == 1 and list(marker[0].get_xdata()) == [10_000] and list(marker[0].get_ydata()) == [2.0]
