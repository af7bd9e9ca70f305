"""The layouts a plan weighs, each traced once on one fake model and simulated: its peak, what it recomputes
(read off its trace), its roofline time; traced in forked workers where cores allow (memplan.planner.plan)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memplan.checkpoint_layout import CheckpointLayout
from memplan.estimator.checkpointing import layout_applied
from memplan.estimator.cuda.roofline import step_seconds
from memplan.estimator.estimate import Progress, step_flops
from memplan.estimator.liveness import Liveness
from memplan.estimator.replay import OptimizerRecording
from memplan.estimator.simulate import Simulation, simulate
from memplan.estimator.trace import FakeSetup, trace_step
from memplan.estimator.traced_step import TracedStep
from memplan.forked import can_fork, map_forked
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings


@dataclass(frozen=True)
class PlanOption:
    """One checkpointing layout, traced and simulated."""

    name: str
    layout: CheckpointLayout
    fits: bool
    predicted_peak_bytes: int
    recompute_flops: int
    recompute_seconds: float | None = None  # cuda: roofline time the recomputation adds to the step
    reserved_peak_bytes: int | None = None  # cuda: max_memory_reserved of the layout's step
    smallest_device_bytes: int | None = None  # cuda: what the budget is compared with (Simulation.fit_bytes)

    def to_dict(self) -> dict[str, Any]:
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {**data, "layout": self.layout.to_dict()}


# A layout's simulated step: the simulation, its roofline seconds (cuda), its FLOPs.
_Measured = tuple[Simulation, float | None, int | None]


def _measure(traced: TracedStep, layout: CheckpointLayout, lifetimes: Liveness | None = None) -> _Measured:
    return simulate(traced, lifetimes), step_seconds(traced), step_flops(traced)


def _trace_length(layout: CheckpointLayout) -> int:
    """Checkpointed modules are traced twice (forward and recomputation): the longest traces go first."""
    return sum(len(segment) for segment in layout.segments)


class LayoutTracer:
    """Traces layouts on one fake model, each layout once."""

    def __init__(
        self, spec: ModelSpec, settings: TrainingSettings, setup: FakeSetup, report: Progress, jobs: int
    ) -> None:
        self.spec, self.settings, self.setup, self.report, self.jobs = spec, settings, setup, report, jobs
        self.simulations: dict[CheckpointLayout, Simulation] = {}
        self.step_seconds: dict[CheckpointLayout, float | None] = {}  # roofline time of each layout's step
        self.step_flops: dict[CheckpointLayout, int] = {}  # FLOPs of each layout's step, off its trace
        self.traces = 0
        # Checkpointing and batch size leave the optimizer step alone: the first trace's is replayed.
        self.optimizer_recording: OptimizerRecording | None = None

    def trace(self, layout: CheckpointLayout, batch_size: int) -> TracedStep:
        self.traces += 1
        with layout_applied(self.setup.state.built_model, layout):
            settings = self.settings.replace(batch_size=batch_size, checkpoint=layout)
            traced = trace_step(self.spec, settings, self.setup, self.optimizer_recording)
        self.optimizer_recording = self.optimizer_recording or traced.optimizer_recording
        return traced

    def record(self, layout: CheckpointLayout, traced: TracedStep, lifetimes: Liveness | None = None) -> Simulation:
        """Simulate and time a trace at the planned batch size."""
        self._store(layout, _measure(traced, layout, lifetimes))
        return self.simulations[layout]

    def _store(self, layout: CheckpointLayout, measured: _Measured) -> None:
        self.simulations[layout], self.step_seconds[layout], flops = measured
        if flops is not None:
            self.step_flops[layout] = flops

    def _trace_and_measure(self, layout: CheckpointLayout) -> _Measured:
        return _measure(self.trace(layout, self.settings.batch_size), layout)

    def simulation(self, layout: CheckpointLayout) -> Simulation:
        if layout not in self.simulations:
            self.report(f"tracing with {layout.describe()}")
            self.record(layout, self.trace(layout, self.settings.batch_size))
        return self.simulations[layout]

    def prefetch(self, layouts: list[CheckpointLayout]) -> None:
        """Trace the layouts not traced yet, in forked workers when there are cores for them."""
        missing = sorted(set(layouts) - set(self.simulations), key=_trace_length, reverse=True)
        workers = min(self.jobs, len(missing)) if can_fork() else 1
        if workers < 2:
            return  # each is traced in this process when first asked for, and reported then
        self.report(f"tracing {len(missing)} layouts in {workers} processes")
        for layout, measured in zip(missing, map_forked(self._trace_and_measure, missing, workers), strict=True):
            self._store(layout, measured)
        self.traces += len(missing)

    def peak(self, layout: CheckpointLayout) -> int:
        return self.simulation(layout).peak_bytes

    def recompute_seconds(self, layout: CheckpointLayout) -> float | None:
        """Roofline time the layout adds over no checkpointing (cuda targets only)."""
        self.simulation(layout)
        planned, plain = self.step_seconds[layout], self.step_seconds[CheckpointLayout()]
        return planned - plain if planned is not None and plain is not None else None

    def recompute_flops(self, layout: CheckpointLayout) -> int:
        """What the layout's step recomputes, read off the traces: its FLOPs beyond the step without checkpointing.
        The cost model's figure (ChainCosts.recompute_flops) ranks layouts for the solver; it charges what a
        non-reentrant checkpoint recomputes up to its early stop (memplan.planner.costs._early_stops), and this one
        is what `estimate --checkpoint` of the plan shows."""
        self.simulation(layout)
        return self.step_flops[layout] - self.step_flops[CheckpointLayout()]

    def option(self, name: str, layout: CheckpointLayout, recompute_flops: int, budget_bytes: int) -> PlanOption:
        simulation = self.simulation(layout)
        return PlanOption(
            name,
            layout,
            simulation.fits_within(budget_bytes),
            simulation.peak_bytes,
            recompute_flops,
            self.recompute_seconds(layout),
            simulation.reserved_peak_bytes,
            simulation.smallest_device_bytes,
        )

    def fits(self, layout: CheckpointLayout, budget_bytes: int) -> bool:
        """Whether the layout's step fits the budget, decided at the budget (Simulation.fits_within)."""
        return self.simulation(layout).fits_within(budget_bytes)

    def fit_bytes(self, layout: CheckpointLayout) -> int:
        """What the budget must hold: on cuda the least memory the step completes in, the allocated
        peak on cpu (Simulation.fit_bytes)."""
        return self.simulation(layout).fit_bytes
