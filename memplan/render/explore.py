"""Render sweeps, technique comparisons and card choices as rich tables; JSON through their to_dict()."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memplan.explore.compare import CompareResult
from memplan.explore.gpus import GpuChoiceResult
from memplan.explore.sweep import SweepPoint, SweepResult
from memplan.render.estimate import describe_settings
from memplan.render.units import format_flops
from memplan.sizes import format_bytes

OVER = " ✗"  # a budget's verdict in text as well as colour: logs and pipes have no colour


def _peak_cell(peak_bytes: int, fits: bool | None) -> str:
    if fits is None:
        return format_bytes(peak_bytes)
    return f"[green]{format_bytes(peak_bytes)}[/green]" if fits else f"[red]{format_bytes(peak_bytes)}{OVER}[/red]"


def _sweep_cell(point: SweepPoint) -> str:
    text = format_bytes(point.peak_bytes)
    if point.smallest_device_bytes is not None:
        text += f" ({format_bytes(point.smallest_device_bytes)})"
    if point.fits is None:
        return text
    return f"[green]{text}[/green]" if point.fits else f"[red]{text}{OVER}[/red]"


def sweep_settings(result: SweepResult) -> str:
    """The sweep's settings as its heading (and its plot's title) gives them: without the checkpointing, and
    without the precision where several are swept (each series names its own)."""
    base = result.settings.replace(checkpoint="none")
    described = describe_settings(base, with_batch=False)
    if len({series.precision for series in result.series}) > 1:
        described = ", ".join(part for part in described.split(", ") if part != base.precision)
    return described


def render_sweep(result: SweepResult, console: Console) -> None:
    console.print(f"[bold]{result.model}[/bold]: {sweep_settings(result)}")
    reserved = result.settings.device == "cuda"
    table = Table(title="predicted peak" + (" (memory it completes in)" if reserved else ""), title_justify="left")
    table.add_column("batch", justify="right")
    for series in result.series:
        table.add_column(series.label, justify="right")
    batch_sizes = [point.batch_size for point in result.series[0].points]
    for row, batch in enumerate(batch_sizes):
        cells = [_sweep_cell(series.points[row]) for series in result.series]
        table.add_row(str(batch), *cells)
    if result.budget_bytes is not None:
        table.add_row(
            "[bold]largest[/bold]", *[f"[bold]{series.max_batch_size or 'none'}[/bold]" for series in result.series]
        )
    console.print(table)
    if result.budget_bytes is not None:
        fit = "the memory each step completes in" if result.settings.device == "cuda" else "each peak"
        console.print(
            f"[dim]budget {format_bytes(result.budget_bytes)}, compared with {fit}: green fits, red and ✗ "
            "do not; 'largest' is the largest batch size that fits[/dim]"
        )
    traces = sum(series.traces for series in result.series)
    interpolated = sum(not point.traced for series in result.series for point in series.points)
    from_lines = f", {interpolated} batch sizes from the lines through traced ones" if interpolated else ""
    console.print(f"[dim]{traces} trace{'' if traces == 1 else 's'}{from_lines}; {result.seconds:.1f} s[/dim]")


def render_compare(result: CompareResult, console: Console) -> None:
    several = result.gpus > 1 and result.settings.parallel == "none"  # a rank's own header names its world size
    on_gpus = f", rows on {result.gpus} data-parallel GPUs" if several else ""
    console.print(f"[bold]{result.model}[/bold]: {describe_settings(result.settings)}{on_gpus}")
    table = Table(title="techniques, each traced and simulated", title_justify="left")
    # Where there is room (a 120-column pipe or wider), the names wrap (sharding rows' run past 80 characters) and
    # the figures do not: with the names on one line, a pipe cut the figures' columns to "optimi…" and "+30897…%".
    # On a narrower terminal every column wraps.
    wide = console.width >= 100
    table.add_column("technique", max_width=36 if wide else None, no_wrap=not wide)
    for column in ("batch", "peak", "vs given", "optimizer", "activations"):
        table.add_column(column, justify="right", no_wrap=wide)
    table.add_column("costs", min_width=24 if wide else None)
    reference = result.rows[0].estimate.peak_bytes
    for row in result.rows:
        e = row.estimate
        s = e.settings
        batch = f"{s.batch_size}×{s.grad_accum}" + (f"×{result.gpus}" if result.gpus > 1 else "")
        batch += f" = {row.effective_batch_size}"
        change = (e.peak_bytes - reference) / reference if reference else 0.0
        cost = row.cost
        if row.recompute_flops is not None:
            share = row.recompute_flops / (e.step_flops - row.recompute_flops)
            cost = f"recompute {format_flops(row.recompute_flops)} (+{share:.0%} FLOPs)"
        table.add_row(
            row.name,
            batch,
            _peak_cell(e.peak_bytes, row.fits),
            "" if row is result.rows[0] else f"{change:+.1%}",
            format_bytes(e.breakdown.optimizer_state),
            format_bytes(e.breakdown.activations),
            cost,
        )
    console.print(table)
    console.print(
        "[dim]batch = micro-batch × accumulation steps"
        + (" × GPUs" if result.gpus > 1 else "")
        + " = effective batch; memory is per GPU (data parallel replicates it)."
        + " Optimizer and activations: bytes live at each row's peak."
        + " `memplan sweep` finds the largest batch for a technique."
        + "[/dim]"
    )
    if result.budget_bytes is not None:
        fit = "the memory each step completes in" if result.settings.device == "cuda" else "each peak"
        console.print(
            f"[dim]budget {format_bytes(result.budget_bytes)}, compared with {fit}: green fits, red and ✗ do not[/dim]"
        )
    for reason in result.skipped:
        console.print(f"[dim]skipped {reason}[/dim]")
    console.print(f"[dim]{result.seconds:.1f} s[/dim]")


def render_gpu_choice(result: GpuChoiceResult, console: Console) -> None:
    console.print(f"[bold]{result.model}[/bold]: {describe_settings(result.settings)}")
    table = Table(title="on each card, its usable memory the budget", title_justify="left")
    for column in ("card", "usable", "peak", "completes in", "fits", "largest batch", "$ per hour"):
        table.add_column(column, justify="left" if column == "card" else "right")
    for option in result.options:
        e = option.estimate
        fits = "[green]yes[/green]" if e.fits else f"[red]no{OVER}[/red]"
        largest = f"≥ {e.max_batch_size:,}" if e.max_batch_size_is_limit else f"{e.max_batch_size or 0:,}"
        price = f"{option.price.usd_per_hour:.2f} ({option.price.provider})" if option.price else "–"
        table.add_row(
            option.gpu,
            format_bytes(e.budget_bytes or 0),
            format_bytes(e.peak_bytes),
            format_bytes(e.fit_bytes),
            fits,
            largest,
            price,
        )
    console.print(table)
    cheapest = result.cheapest
    if not result.fitting:
        console.print("[red]it fits none of these cards[/red]: `memplan compare` shows what each technique saves")
    elif cheapest is not None and cheapest.price is not None:
        console.print(
            f"cheapest that fits: [bold]{cheapest.gpu}[/bold], ${cheapest.price.usd_per_hour:.2f} per hour "
            f"({cheapest.price.provider}, as listed {cheapest.price.checked})"
        )
    else:
        names = ", ".join(option.gpu for option in result.fitting)
        console.print(f"fits {names}; memplan has no listed price for these cards")
    nccl = " and NCCL's buffers (a data-parallel rank)" if result.settings.parallel != "none" else ""
    console.print(
        f"[dim]usable: the card's memory less the CUDA context{nccl}; completes in: the least memory the step runs in, "
        "what is compared. Prices: one hour of one card on demand, from memplan.prices (its source and date); "
        "they change often[/dim]"
    )
    console.print(f"[dim]{result.seconds:.1f} s[/dim]")
