"""Render validation results: one configuration, or a suite's table and summary."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from memplan.render.estimate import describe_settings
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes
from memplan.validate.result import ValidationResult


def _size(value: int | None) -> str:
    return format_bytes(value) if value is not None else "—"


def _error(value: float | None) -> str:
    return f"{value:+.3%}" if value is not None else "—"


def validation_to_json(result: ValidationResult) -> str:
    return json.dumps(result.to_dict(), indent=2)


def render_validation(result: ValidationResult, console: Console) -> None:
    settings = TrainingSettings.from_dict(result.settings)
    console.print(f"[bold]{result.model}[/bold]: {describe_settings(settings)}")
    if result.device_name != "unknown":  # a measurement stopped before it reported its device (a timeout) says so below
        console.print(f"measured on {result.device_name}, torch {result.torch_version}")
    if result.error is not None:
        console.print(f"[red]{result.error}[/red]")
        if not result.out_of_memory:
            return
    table = Table(title_justify="left")
    for column in ("", "predicted", "measured", "error"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row(
        "peak (max_memory_allocated)" if result.device == "cuda" else "peak (live tensor storage)",
        _size(result.predicted_peak_bytes),
        _size(result.measured_peak_bytes),
        _error(result.relative_error),
    )
    if result.device == "cuda":
        table.add_row(
            "reserved (max_memory_reserved)",
            _size(result.predicted_reserved_bytes),
            _size(result.measured_reserved_bytes),
            _error(result.reserved_relative_error),
        )
        table.add_row(
            "device (nvidia-smi)", _size(result.predicted_device_bytes), _size(result.measured_device_bytes), ""
        )
    console.print(table)
    if result.snapshot:
        console.print(
            f"memory snapshot: {result.snapshot} "
            f"(python -m torch.cuda._memory_viz trace_plot {result.snapshot} -o page.html)"
        )


def suite_row(config_id: str, result: ValidationResult) -> tuple[str, ...]:
    status = "OOM" if result.out_of_memory else "failed" if result.error else ""
    return (
        config_id,
        _size(result.predicted_peak_bytes),
        _size(result.measured_peak_bytes) if not status else status,
        _error(result.relative_error),
        _size(result.predicted_reserved_bytes),
        _size(result.measured_reserved_bytes) if not status else status,
        _error(result.reserved_relative_error),
    )


def render_suite(rows: list[tuple[str, ValidationResult]], summary: dict, console: Console) -> None:
    table = Table(title="predicted vs measured", title_justify="left")
    for column in (
        "config",
        "peak predicted",
        "peak measured",
        "error",
        "reserved predicted",
        "reserved measured",
        "error",
    ):
        table.add_column(column, justify="left" if column == "config" else "right")
    for config_id, result in rows:
        table.add_row(*suite_row(config_id, result))
    console.print(table)
    if summary["measured"]:
        console.print(
            f"{summary['measured']} measured, {summary['failed']} failed or out of memory; "
            f"median |error| {summary['median_abs_error']:.2%}, largest {summary['max_abs_error']:.2%}"
            + (
                f"; reserved median |error| {summary['median_abs_reserved_error']:.2%}"
                if summary["median_abs_reserved_error"] is not None
                else ""
            )
        )
    for config_id, result in rows:
        if result.error:
            console.print(f"[yellow]{config_id}[/yellow]: {result.error}")
