"""Batch size and checkpointing plan together: the best throughput estimate within a byte budget.

A larger micro-batch uses the GPU better (weights, optimizer state and launches are paid once per
step), but past the largest batch that fits without checkpointing it needs checkpointing, which
recomputes. memplan finds the largest batch that fits with no checkpointing and with every block
checkpointed, plans the least-recompute layout for batch sizes between them, and ranks them by
samples per second of the roofline time of each planned step (memplan.estimator.cuda.roofline):
e.g. "batch 24 with 6 blocks checkpointed beats batch 32 with all 12". Every option is a plan:
traced, simulated and fitting the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memplan.errors import SettingsError
from memplan.estimator.batch_tracer import BatchTracer
from memplan.estimator.search import MAX_BATCH_SIZE
from memplan.models.source import ModelSpec
from memplan.planner.plan import PlanResult, make_plan
from memplan.results import fields_dict
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes

Progress = Callable[[str], None]
# Batch sizes planned between the two ends (log-spaced), besides the ends themselves.
INTERMEDIATE_BATCHES = 4


@dataclass(frozen=True)
class BatchOption:
    batch_size: int
    plan: PlanResult

    @property
    def samples_per_second(self) -> float:
        assert self.plan.step_seconds is not None
        return self.batch_size / self.plan.step_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "checkpointed_modules": len(self.plan.layout.modules),
            "checkpoints": len(self.plan.layout.segments),
            "layout": self.plan.layout.to_dict(),
            "predicted_peak_bytes": self.plan.predicted_peak_bytes,
            "reserved_peak_bytes": self.plan.reserved_peak_bytes,
            "smallest_device_bytes": self.plan.smallest_device_bytes,  # the text's "completes in", set to the budget
            "recompute_flops": self.plan.recompute_flops,
            "step_seconds": self.plan.step_seconds,
            "samples_per_second": self.samples_per_second,
        }


@dataclass(frozen=True)
class MaximizeResult:
    model: str
    settings: TrainingSettings  # the base settings; each option has its own batch size and layout
    budget_bytes: int
    candidates: int  # blocks that may be checkpointed
    options: tuple[BatchOption, ...]  # by batch size
    best: BatchOption
    seconds: float
    # The largest batch searched is memplan's limit (MAX_BATCH_SIZE): larger ones may fit too
    largest_is_limit: bool = False

    def _repr_html_(self) -> str:
        """Jupyter's view: the CLI's report (memplan.render.notebook)."""
        from memplan.render.notebook import recorded_html
        from memplan.render.plan import render_batch_options

        return recorded_html(lambda console: render_batch_options(self, console))

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def _between(low: int, high: int) -> list[int]:
    """low, high and INTERMEDIATE_BATCHES log-spaced batch sizes between them."""
    sizes = {low, high}
    for step in range(1, INTERMEDIATE_BATCHES + 1):
        sizes.add(round(low * (high / low) ** (step / (INTERMEDIATE_BATCHES + 1))))
    return sorted(size for size in sizes if low <= size <= high)


def maximize_batch(
    spec: ModelSpec,
    settings: TrainingSettings,
    budget_bytes: int,
    *,
    candidates: str | None = None,
    solver: str = "auto",
    progress: Progress | None = None,
    jobs: int | None = None,
) -> MaximizeResult:
    started = time.perf_counter()
    report = progress or (lambda message: None)
    if settings.device != "cuda":
        raise SettingsError("--maximize-batch ranks by a GPU time estimate: use it with --device cuda (and --gpu)")
    settings = spec.settings_for(settings)
    ends, setups = {}, {}
    for mode in ("none", "all"):
        report(f"largest batch with checkpoint {mode}")
        tracer = BatchTracer(spec, settings.replace(checkpoint=mode), report)
        ends[mode], setups[mode] = tracer.max_batch_size(budget_bytes), tracer.setup
    if ends["all"] == 0:
        # the "all" tracer's own batch size, traced already by its search
        workspaces = tracer.simulate(tracer.settings.batch_size).breakdown["workspaces"]
        if 2 * workspaces >= budget_bytes:  # library workspaces, which no precision or optimizer changes
            raise SettingsError(
                f"not even batch size 1 fits with every block checkpointed: cuBLAS and cuDNN workspaces alone take "
                f"{format_bytes(workspaces)} of the {format_bytes(budget_bytes)} budget; try --cublas-workspace-config "
                ":16:8 (8 workspaces of 16 KiB), or a larger budget"
            )
        raise SettingsError(
            "not even batch size 1 fits with every block checkpointed; try --precision amp-bf16 or bf16, "
            "or --optimizer adam8bit or adafactor"
        )
    options = []
    for batch in _between(max(ends["none"], 1), ends["all"]):
        report(f"planning batch size {batch}")
        plan = make_plan(
            spec,
            settings.replace(batch_size=batch, checkpoint="none"),
            budget_bytes,
            candidates=candidates,
            solver=solver,
            setup=setups["none"],  # one fake model for every plan
            jobs=jobs,
        )
        if plan.fits:
            options.append(BatchOption(batch, plan))
    if not options:
        # Only when the reserved peak is not monotonic in the batch size (allocator segments).
        raise SettingsError("no planned batch size fits the budget; try a larger budget")
    best = max(options, key=lambda option: option.samples_per_second)
    return MaximizeResult(
        spec.name,
        settings,
        budget_bytes,
        len(options[-1].plan.candidates),
        tuple(options),
        best,
        time.perf_counter() - started,
        largest_is_limit=options[-1].batch_size == MAX_BATCH_SIZE,
    )
