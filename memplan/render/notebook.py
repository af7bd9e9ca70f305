"""Results as HTML for Jupyter (`_repr_html_`): the CLI's own rendering, recorded, plus the
timeline plot inline where matplotlib is installed."""

from __future__ import annotations

import base64
import io
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

_PRE = '<pre style="font-family: Menlo, Consolas, monospace; line-height: 1.25; font-size: 12px">{code}</pre>'


def recorded_html(render: Callable[[Console], Any]) -> str:
    """What `render(console)` prints, as an HTML fragment with inline colours."""
    console = Console(record=True, width=120, file=io.StringIO(), highlight=False)
    render(console)
    return console.export_html(inline_styles=True, code_format=_PRE)


def timeline_png_html(timeline: Any, title: str, budget_bytes: int | None, reserved_peak_bytes: int | None) -> str:
    """The timeline plot as an inline PNG, or nothing where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ""
    from memplan.render.plot import plot_timeline

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "timeline.png"
        plot_timeline(timeline, path, title=title, budget_bytes=budget_bytes, reserved_peak_bytes=reserved_peak_bytes)
        encoded = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="memory timeline" style="max-width: 100%" src="data:image/png;base64,{encoded}"/>'


def estimate_html(result: Any) -> str:
    from memplan.render.estimate import describe_settings, render_estimate

    html = recorded_html(lambda console: render_estimate(result, console))
    if result.timeline is not None:
        title = f"{result.model}: {describe_settings(result.settings)}"
        html += timeline_png_html(result.timeline, title, result.budget_bytes, result.reserved_peak_bytes)
    return html
