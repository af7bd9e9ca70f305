"""Render a PlanResult: the plan, the baselines beside it, and what to do when nothing fits."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from memplan.planner.plan import PlanResult
from memplan.render.estimate import describe_settings
from memplan.settings import CheckpointLayout, format_bytes


def plan_to_json(result: PlanResult) -> str:
    return json.dumps(result.to_dict(), indent=2)


def describe_layout(layout: CheckpointLayout) -> str:
    if not layout.segments:
        return "no checkpointing"
    parts = [
        segment[0] if len(segment) == 1 else f"{segment[0]} … {segment[-1]} (one segment)"
        for segment in layout.segments
    ]
    return ", ".join(parts)


def format_flops(value: int) -> str:
    return f"{value / 1e12:,.2f} TFLOP" if value >= 1e11 else f"{value / 1e9:,.2f} GFLOP"


def render_plan(result: PlanResult, console: Console, output: str | None = None) -> None:
    console.print(f"[bold]{result.model}[/bold]: {describe_settings(result.settings.replace(checkpoint='none'))}")
    console.print(f"budget {format_bytes(result.budget_bytes)}; {len(result.candidates)} candidate blocks")
    table = Table(title="checkpointing, each re-traced and simulated", title_justify="left")
    table.add_column("layout")
    table.add_column("predicted peak", justify="right")
    table.add_column("fits")
    table.add_column("recompute", justify="right")
    table.add_column("of the step", justify="right")
    rows = [
        (
            f"[bold]plan[/bold] ({result.layout.describe()})",
            result.predicted_peak_bytes,
            result.fits,
            result.recompute_flops,
        )
    ]
    rows += [
        (option.name, option.predicted_peak_bytes, option.fits, option.recompute_flops) for option in result.baselines
    ]
    for name, peak, fits, flops in rows:
        share = flops / result.step_flops if result.step_flops else 0.0
        table.add_row(
            name,
            format_bytes(peak),
            "[green]yes[/green]" if fits else "[red]no[/red]",
            format_flops(flops),
            f"+{share:.1%}",
        )
    console.print(table)
    if result.fits and not result.layout.segments:
        console.print("[green]plan[/green]: no checkpointing needed, the step fits as it is")
    elif result.fits:
        console.print(f"[green]plan[/green]: checkpoint {describe_layout(result.layout)}")
    else:
        console.print(
            f"[red]nothing fits[/red]: the least memory found is {format_bytes(result.predicted_peak_bytes)} "
            f"({describe_layout(result.layout)}), {format_bytes(result.over_budget_bytes)} over budget"
        )
        for suggestion in result.suggestions:
            console.print(f"  try {suggestion}")
    if output:
        console.print(
            f"plan written to {output}; use it with `memplan estimate --checkpoint {output}` or memplan.apply_plan"
        )
    console.print(f"[dim]{result.traces} traces, {result.seconds:.1f} s[/dim]")
