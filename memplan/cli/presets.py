"""`memplan presets`."""

from __future__ import annotations

import click


@click.command()
def presets() -> None:
    """List the model presets shipped with memplan."""
    from rich.console import Console

    from memplan.render.presets import render_presets

    render_presets(Console(highlight=False))
