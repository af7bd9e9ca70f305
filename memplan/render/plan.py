"""Render a PlanResult: the plan, the baselines beside it, and what to do when nothing fits."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from memplan.checkpoint_layout import CheckpointLayout
from memplan.planner.maximize import MaximizeResult
from memplan.planner.plan import PlanResult
from memplan.render.estimate import describe_settings
from memplan.render.units import format_flops, format_seconds
from memplan.sizes import format_bytes


def plan_to_json(result: PlanResult) -> str:
    return json.dumps(result.to_dict(), indent=2)


def describe_layout(layout: CheckpointLayout) -> str:
    if not layout.segments:
        return "no checkpointing"
    parts = [
        (segment[0] if len(segment) == 1 else f"{segment[0]} … {segment[-1]} (one segment)")
        + (" (selective)" if policy == "selective" else "")
        for segment, policy in zip(layout.segments, layout.policies, strict=True)
    ]
    return ", ".join(parts)


def render_plan(result: PlanResult, console: Console, output: str | None = None) -> None:
    console.print(f"[bold]{result.model}[/bold]: {describe_settings(result.settings.replace(checkpoint='none'))}")
    console.print(f"budget {format_bytes(result.budget_bytes)}; {len(result.candidates)} candidate blocks")
    table = Table(title="checkpointing, each re-traced and simulated", title_justify="left")
    table.add_column("layout")
    table.add_column("predicted peak", justify="right")
    reserved = result.reserved_peak_bytes is not None
    if reserved:
        table.add_column("reserved", justify="right")
        table.add_column("completes in", justify="right")
    table.add_column("fits")
    table.add_column("recompute", justify="right")
    table.add_column("of the step", justify="right")
    timed = result.recompute_seconds is not None
    if timed:
        table.add_column("roofline time", justify="right")
    rows = [
        (
            f"[bold]plan[/bold] ({result.layout.describe()})",
            result.predicted_peak_bytes,
            (result.reserved_peak_bytes, result.smallest_device_bytes),
            result.fits,
            result.recompute_flops,
            result.recompute_seconds,
        )
    ]
    rows += [
        (
            option.name,
            option.predicted_peak_bytes,
            (option.reserved_peak_bytes, option.smallest_device_bytes),
            option.fits,
            option.recompute_flops,
            option.recompute_seconds,
        )
        for option in result.baselines
    ]
    for name, peak, device_figures, fits, flops, seconds in rows:
        share = flops / result.step_flops if result.step_flops else 0.0
        cells = [name, format_bytes(peak)]
        if reserved:
            cells += [format_bytes(value) if value is not None else "" for value in device_figures]
        cells += ["[green]yes[/green]" if fits else "[red]no[/red]", format_flops(flops)]
        cells.append(f"+{share:.1%}")
        if timed:
            cells.append(f"+{format_seconds(seconds)}" if seconds is not None else "")
        table.add_row(*cells)
    console.print(table)
    if reserved:
        console.print(
            "[dim]fits: the memory the step completes in within the budget (at most the reserved peak: short of "
            "memory the caching allocator frees its cached segments and retries)[/dim]"
        )
    if result.fits and not result.layout.segments:
        console.print("[green]plan[/green]: no checkpointing needed, the step fits as it is")
    elif result.fits:
        console.print(f"[green]plan[/green]: checkpoint {describe_layout(result.layout)}")
    else:
        device = result.smallest_device_bytes
        least = format_bytes(result.predicted_peak_bytes)
        if device is not None:
            least += f" allocated, completing in {format_bytes(device)} (what the budget must hold)"
        console.print(
            f"[red]nothing fits[/red]: the least memory found is {least} "
            f"({describe_layout(result.layout)}), {format_bytes(result.over_budget_bytes)} over budget"
        )
        for suggestion in result.suggestions:
            console.print(f"  try {suggestion}")
    if output:
        console.print(
            f"plan written to {output}; use it with `memplan estimate --checkpoint {output}` or memplan.apply_plan"
        )
    if result.step_seconds is not None:
        console.print(
            f"[dim]roofline time: a lower bound from the card's datasheet peaks; the planned step "
            f"{format_seconds(result.step_seconds)}[/dim]"
        )
    console.print(f"[dim]{result.traces} traces, {result.seconds:.1f} s[/dim]")


def render_batch_options(result: MaximizeResult, console: Console, output: str | None = None) -> None:
    base = result.settings.replace(checkpoint="none")
    console.print(f"[bold]{result.model}[/bold]: {describe_settings(base, with_batch=False)}")
    console.print(f"budget {format_bytes(result.budget_bytes)}; {result.candidates} candidate blocks")
    table = Table(title="batch size and plan, each traced and fitting", title_justify="left")
    table.add_column("batch", justify="right")
    table.add_column("checkpointed", justify="right")
    table.add_column("peak", justify="right")
    table.add_column("completes in", justify="right")
    table.add_column("recompute", justify="right")
    table.add_column("roofline step", justify="right")
    table.add_column("samples/s", justify="right")
    for option in result.options:
        plan = option.plan
        style = "bold green" if option is result.best else ""
        table.add_row(
            str(option.batch_size),
            f"{len(plan.layout.modules)} of {result.candidates}",
            format_bytes(plan.predicted_peak_bytes),
            format_bytes(plan.smallest_device_bytes) if plan.smallest_device_bytes is not None else "",
            format_flops(plan.recompute_flops),
            format_seconds(plan.step_seconds) if plan.step_seconds is not None else "",
            f"{option.samples_per_second:,.1f}",
            style=style,
        )
    console.print(table)
    best = result.best
    largest = result.options[-1]
    verdict = f"best: batch {best.batch_size} with {len(best.plan.layout.modules)} blocks checkpointed"
    if result.largest_is_limit and best is largest:
        verdict += " (memplan's search limit: larger batches may fit too)"
    if largest is not best:
        verdict += (
            f" beats batch {largest.batch_size} with {len(largest.plan.layout.modules)}: "
            f"{best.samples_per_second:,.1f} vs {largest.samples_per_second:,.1f} samples/s"
        )
    console.print(verdict)
    console.print(
        "[dim]samples/s = batch / roofline step time: an upper bound from the card's datasheet peaks, "
        "for ranking options on one card[/dim]"
    )
    if output:
        console.print(f"the best option's plan written to {output} (train with --batch-size {best.batch_size})")
    console.print(f"[dim]{result.seconds:.1f} s[/dim]")
