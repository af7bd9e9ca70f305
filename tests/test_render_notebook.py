"""Jupyter's view of results (`_repr_html_`): the report the CLI prints, and the timeline plot."""

from __future__ import annotations

import base64
import re

import memplan


def test_an_estimate_shows_its_report_and_its_timeline_in_a_notebook():
    result = memplan.estimate("tiny-gpt2", batch_size=2, seq_len=64, device="cpu")
    html = result._repr_html_()
    assert html.startswith("<pre") and "memory at the peak" in html
    assert memplan.format_bytes(result.peak_bytes) in html and "peak by phase" in html
    image = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert image is not None and base64.b64decode(image.group(1)).startswith(b"\x89PNG\r\n\x1a\n")


def test_sweeps_comparisons_and_plans_show_their_tables():
    sweep = memplan.sweep("tiny-gpt2", seq_len=32, batch_sizes=(1, 2), device="cpu")
    html = sweep._repr_html_()
    assert all(memplan.format_bytes(point.peak_bytes) in html for series in sweep.series for point in series.points)
    compare = memplan.compare("tiny-gpt2", seq_len=32, batch_size=2, device="cpu")
    html = compare._repr_html_()
    assert all(row.name in html for row in compare.rows)
    plan = memplan.plan("tiny-gpt2", seq_len=32, batch_size=2, device="cpu", budget="64MiB")
    html = plan._repr_html_()
    assert memplan.format_bytes(plan.predicted_peak_bytes) in html and memplan.format_bytes(plan.budget_bytes) in html
