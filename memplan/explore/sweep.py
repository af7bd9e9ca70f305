"""Peak memory against batch size for several settings: the picture for choosing a batch and a technique.

Each setting's batch sizes are traced from the ends inwards: the largest, the smallest above 1, one
between. Where that third trace lands, request by request, on the lines through the other two, the
remaining batch sizes are answered from those lines through the allocator simulator, exactly as
the largest-batch search does (memplan.estimator.interpolate); a step that changes with the batch
size is traced at every point. Batch size 1 is always traced. The largest batch that fits the
budget is found per setting by the same search `estimate` uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from memplan.distributed.deepspeed_file import file_precision
from memplan.errors import SettingsError
from memplan.estimator.batch_tracer import BatchTracer, Progress
from memplan.forked import imap_forked, side_by_side_workers
from memplan.models.source import ModelSpec
from memplan.results import fields_dict
from memplan.settings import CHECKPOINT_MODES, PRECISIONS, TrainingSettings

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def series_label(precision: str, checkpoint: str) -> str:
    return precision + (f", checkpoint {checkpoint}" if checkpoint != "none" else "")


@dataclass(frozen=True)
class SweepPoint:
    batch_size: int
    peak_bytes: int
    reserved_peak_bytes: int | None
    fits: bool | None
    smallest_device_bytes: int | None = None  # cuda: the least memory the step completes in, what fits compare
    traced: bool = True  # False: from the lines through three traced batch sizes

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


@dataclass(frozen=True)
class SweepSeries:
    precision: str
    checkpoint: str
    points: tuple[SweepPoint, ...]
    max_batch_size: int | None  # with a budget: the largest batch size that fits (0: none does)
    traces: int = 0  # the steps traced for this setting, the largest-batch search's included

    @property
    def label(self) -> str:
        return series_label(self.precision, self.checkpoint)

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self, label=self.label)


@dataclass(frozen=True)
class SweepResult:
    model: str
    settings: TrainingSettings  # the base settings; each series overrides precision and checkpoint
    budget_bytes: int | None
    series: tuple[SweepSeries, ...]
    seconds: float
    interrupted: bool = False  # Ctrl-C stopped it: `series` are the settings finished before

    def _repr_html_(self) -> str:
        """Jupyter's view: the CLI's report (memplan.render.notebook)."""
        from memplan.render.explore import render_sweep
        from memplan.render.notebook import recorded_html

        return recorded_html(lambda console: render_sweep(self, console))

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def _check(values: tuple[str, ...], known: tuple[str, ...], option: str) -> None:
    unknown = [value for value in values if value not in known]
    if unknown or not values:
        raise SettingsError(f"{option} takes a comma-separated list of {', '.join(known)}; got {','.join(values)}")
    _refuse_repeats(values, option)


def _refuse_repeats(values: tuple[Any, ...], option: str) -> None:
    """A value named twice (the same series or point twice) is a slip: one line."""
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise SettingsError(f"{option} names {', '.join(map(str, repeated))} more than once; name each once")


def _check_file_precision(settings: TrainingSettings, precisions: tuple[str, ...]) -> None:
    """A DeepSpeed file that enables a precision outright runs that one: a sweep over others is one line, as
    --precision is (memplan.distributed.deepspeed_file)."""
    if settings.deepspeed_stage is None:
        return
    enabled = file_precision(settings.deepspeed_settings)
    others = [precision for precision in precisions if precision != enabled]
    if enabled is not None and others:
        raise SettingsError(
            f"the DeepSpeed configuration enables {enabled}, and --precisions has {','.join(others)}: sweep "
            f'{enabled} alone, or leave the file\'s precision to memplan (bf16\'s or fp16\'s "enabled": "auto", '
            "torch_autocast's false)"
        )


def tracing_order(batch_sizes: tuple[int, ...]) -> list[int]:
    """Batch size 1 (never on the lines), then the largest, the smallest above 1 and the middle one
    (the lines through the ends, checked between them), then the rest in order."""
    ordered = sorted(set(batch_sizes))
    above_one = [batch for batch in ordered if batch > 1]
    first = ([1] if 1 in ordered else []) + list(dict.fromkeys(above_one[-1:] + above_one[:1]))
    if len(above_one) > 2:
        first.append(above_one[len(above_one) // 2])
    return first + [batch for batch in ordered if batch not in first]


def _series(
    spec: ModelSpec,
    settings: TrainingSettings,
    series: tuple[str, str],
    batch_sizes: tuple[int, ...],
    budget_bytes: int | None,
    progress: Progress | None,
) -> SweepSeries:
    """One series (precision, checkpoint mode): its points in tracing order (lines once three traces agree)."""
    precision, checkpoint = series
    variant = spec.settings_for(settings.replace(precision=precision, checkpoint=checkpoint))
    tracer = BatchTracer(spec, variant, progress)
    try:
        return _traced_series(tracer, series, tracing_order(batch_sizes), budget_bytes)
    finally:
        tracer.close()  # stops a forked trace no point needed (the lines answered it)


def _traced_series(
    tracer: BatchTracer, series: tuple[str, str], order: list[int], budget_bytes: int | None
) -> SweepSeries:
    """The points in tracing order. Where a point takes a trace in this process, the next one is traced beside it
    in a forked child (BatchTracer.trace_aside): on two cores the first four points, the most a series traces
    before its lines are confirmed, in about the time of two traces."""
    precision, checkpoint = series
    points = []
    for index, batch in enumerate(order):
        if index + 1 < len(order) and tracer.traces_here(batch):
            tracer.trace_aside(order[index + 1], device_fit=True)  # its point reads the device figure
        figures = tracer.figures(batch)
        fits = tracer.fits(batch, budget_bytes) if budget_bytes is not None else None
        points.append(
            SweepPoint(
                batch,
                figures.peak_bytes,
                figures.reserved_peak_bytes,
                fits,
                figures.smallest_device_bytes,
                figures.traced,
            )
        )
    points.sort(key=lambda point: point.batch_size)
    max_batch = tracer.max_batch_size(budget_bytes) if budget_bytes is not None else None
    return SweepSeries(precision, checkpoint, tuple(points), max_batch, len(tracer.simulations))


def run_sweep(
    spec: ModelSpec,
    settings: TrainingSettings,
    *,
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    precisions: tuple[str, ...] | None = None,
    checkpoints: tuple[str, ...] | None = None,
    budget_bytes: int | None = None,
    progress: Progress | None = None,
) -> SweepResult:
    started = time.perf_counter()
    precisions = precisions or (settings.precision,)
    checkpoints = checkpoints or (settings.checkpoint if isinstance(settings.checkpoint, str) else "none",)
    _check(precisions, PRECISIONS, "--precisions")
    _check(checkpoints, CHECKPOINT_MODES, "--checkpoints")
    _check_file_precision(settings, precisions)
    if not batch_sizes or any(batch < 1 for batch in batch_sizes):
        raise SettingsError("--batch-sizes takes positive integers, e.g. 1,2,4,8")
    _refuse_repeats(batch_sizes, "--batch-sizes")
    report = progress or (lambda message: None)
    series: list[SweepSeries] = []
    combinations = [(precision, checkpoint) for precision in precisions for checkpoint in checkpoints]
    labels = [
        f"[{number}/{len(combinations)}] {series_label(precision, checkpoint)}"
        for number, (precision, checkpoint) in enumerate(combinations, start=1)
    ]
    # Series side by side in forked workers, one per core (each reports only as it arrives), else one by one
    # here (each reporting its traces as it goes).
    workers = side_by_side_workers(len(combinations))

    def one_series(index: int) -> SweepSeries:
        label = labels[index]
        here = None if workers > 1 else lambda message: report(f"{label}: {message}")
        return _series(spec, settings, combinations[index], batch_sizes, budget_bytes, here)

    traced = imap_forked(one_series, range(len(combinations)), workers, probed=True)
    interrupted = False
    try:
        for label in labels:
            if workers > 1:
                report(f"{label}: tracing in a forked process")
            series.append(next(traced))
    except KeyboardInterrupt:
        if not series:
            raise  # nothing finished to show
        interrupted = True  # keep what is finished; the caller shows it and exits as interrupted
    finally:
        traced.close()  # stops the workers of series not needed
    seconds = time.perf_counter() - started
    return SweepResult(spec.name, spec.settings_for(settings), budget_bytes, tuple(series), seconds, interrupted)
