"""The `memplan presets` listing."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memplan.models.presets import all_presets


def render_presets(console: Console) -> None:
    table = Table(title="presets (config data shipped with memplan; no weights)", title_justify="left")
    table.add_column("name", no_wrap=True)
    for column in ("model type", "task", "config of"):
        table.add_column(column, overflow="fold")
    for preset in all_presets().values():
        table.add_row(preset.name, preset.model_type, preset.task, preset.hub_id)
    console.print(table)
