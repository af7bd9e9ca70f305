"""Settings + model + byte budget -> the least-recompute checkpointing plan that fits, proven by re-tracing.

1. Trace the step without checkpointing; read each candidate's freed bytes and FLOPs off it.
2. Solve on the cost model (exact DP for chains, greedy for very long ones).
3. Re-trace the step with the solution applied and simulate it: that peak is the prediction. If it
   is over budget (the model is an approximation), tighten the solver's budget by the overshoot
   and solve again.
4. Trace the baselines the same way, and when nothing fits, say by how much and what would.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from memplan.errors import SettingsError
from memplan.estimator.checkpointing import block_names, layout_applied
from memplan.estimator.search import find_max_batch_size
from memplan.estimator.simulate import Simulation, liveness, simulate
from memplan.estimator.trace import FakeSetup, build_fake_setup, trace_step
from memplan.models.source import ModelSpec
from memplan.planner.costs import ChainCosts, chain_costs, select_candidates
from memplan.planner.solvers import Solution, dp, greedy, solution_for
from memplan.planner.solvers.baselines import BASELINES
from memplan.settings import CheckpointLayout, TrainingSettings, format_bytes

SOLVERS: dict[str, Callable[[ChainCosts, int], Solution | None]] = {"dp": dp.solve, "greedy": greedy.solve}
# Above this many candidates "auto" uses the greedy heuristic (the DP's front grows with the chain).
DP_MAX_CANDIDATES = 128
VERIFY_ROUNDS = 4

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PlanOption:
    """One checkpointing layout, traced and simulated."""

    name: str
    layout: CheckpointLayout
    fits: bool
    predicted_peak_bytes: int
    recompute_flops: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fits": self.fits,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "recompute_flops": self.recompute_flops,
            "layout": self.layout.to_dict(),
        }


@dataclass(frozen=True)
class PlanResult:
    model: str
    fingerprint: str
    settings: TrainingSettings  # with checkpoint = the chosen layout
    budget_bytes: int
    fits: bool
    layout: CheckpointLayout  # the plan when it fits; else the layout that came closest
    predicted_peak_bytes: int  # simulated peak of the re-traced, planned step
    model_peak_bytes: int  # what the solver's cost model said
    recompute_flops: int
    step_flops: int  # forward + backward + optimizer without checkpointing
    solver: str
    candidates: tuple[str, ...]
    baselines: tuple[PlanOption, ...]
    over_budget_bytes: int  # 0 when it fits
    suggestions: tuple[str, ...]
    traces: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "settings": self.settings.to_dict(),
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "layout": self.layout.to_dict(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "model_peak_bytes": self.model_peak_bytes,
            "recompute_flops": self.recompute_flops,
            "step_flops": self.step_flops,
            "solver": self.solver,
            "candidates": list(self.candidates),
            "baselines": [option.to_dict() for option in self.baselines],
            "over_budget_bytes": self.over_budget_bytes,
            "suggestions": list(self.suggestions),
            "traces": self.traces,
            "seconds": round(self.seconds, 3),
        }


def model_fingerprint(model: nn.Module) -> str:
    """Module names and parameter shapes: what a plan's module names and costs depend on."""
    described = [[name, list(param.shape)] for name, param in model.named_parameters(remove_duplicate=False)]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def layout_of(costs: ChainCosts, segments: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> CheckpointLayout:
    return CheckpointLayout(segments=tuple(tuple(costs.names[a : b + 1]) for a, b in segments))


class _Tracer:
    """Traces layouts on one fake model, each layout once."""

    def __init__(self, spec: ModelSpec, settings: TrainingSettings, setup: FakeSetup, report: Progress) -> None:
        self.spec, self.settings, self.setup, self.report = spec, settings, setup, report
        self.simulations: dict[CheckpointLayout, Simulation] = {}

    def peak(self, layout: CheckpointLayout) -> int:
        if layout not in self.simulations:
            self.report(f"tracing with {layout.describe()}")
            model = self.setup.state.model
            with layout_applied(model, layout):
                traced = trace_step(self.spec, self.settings.replace(checkpoint=layout), self.setup)
            self.simulations[layout] = simulate(traced)
        return self.simulations[layout].peak_bytes


def _solve_verified(
    costs: ChainCosts, solve: Callable[[ChainCosts, int], Solution | None], tracer: _Tracer, budget_bytes: int
) -> tuple[Solution, int] | None:
    target = budget_bytes
    for _ in range(VERIFY_ROUNDS):
        solution = solve(costs, target)
        if solution is None:
            return None
        peak = tracer.peak(layout_of(costs, solution.segments))
        if peak <= budget_bytes:
            return solution, peak
        target -= peak - budget_bytes  # the model was optimistic here by at least this much
    return None


def make_plan(
    spec: ModelSpec,
    settings: TrainingSettings,
    budget_bytes: int,
    *,
    candidates: str | None = None,
    solver: str = "auto",
    progress: Progress | None = None,
) -> PlanResult:
    started = time.perf_counter()
    report = progress or (lambda message: None)
    if solver not in ("auto", *SOLVERS):
        raise SettingsError(f"solver must be auto, {', '.join(SOLVERS)}; got {solver!r}")
    settings = spec.settings_for(settings).replace(checkpoint="none")
    report("building the model under fake tensors")
    setup = build_fake_setup(spec, settings)
    model = setup.state.model
    names = select_candidates([name for name, _ in model.named_modules()], block_names(model), candidates)
    if not names:
        raise SettingsError(
            f"{spec.name} has no repeated blocks (an nn.ModuleList of same-class modules) to checkpoint; "
            "name candidate modules with --candidates REGEX"
        )
    tracer = _Tracer(spec, settings, setup, report)
    report("tracing without checkpointing")
    traced = trace_step(spec, settings, setup)
    base_simulation = simulate(traced)
    tracer.simulations[CheckpointLayout()] = base_simulation
    costs = chain_costs(traced, liveness(traced), base_simulation, names)
    chosen_solver = solver if solver != "auto" else ("dp" if len(costs) <= DP_MAX_CANDIDATES else "greedy")
    report(f"solving over {len(costs)} candidates ({chosen_solver})")
    found = _solve_verified(costs, SOLVERS[chosen_solver], tracer, budget_bytes)

    baselines = []
    for name, strategy in BASELINES.items():
        segments = strategy(costs)
        layout = layout_of(costs, segments)
        peak = tracer.peak(layout)
        baselines.append(PlanOption(name, layout, peak <= budget_bytes, peak, costs.recompute_flops(segments)))

    if found is not None:
        solution, peak = found
        # The model may rank two layouts differently from their simulations: of everything traced
        # that fits, keep the least recompute, then the lowest peak.
        options = [(solution.recompute_flops, peak, layout_of(costs, solution.segments))]
        options += [(o.recompute_flops, o.predicted_peak_bytes, o.layout) for o in baselines if o.fits]
        flops, peak, layout = min(options, key=lambda option: option[:2])
        suggestions: tuple[str, ...] = ()
    else:
        closest = min(baselines, key=lambda option: option.predicted_peak_bytes)
        layout, peak, flops = closest.layout, closest.predicted_peak_bytes, closest.recompute_flops
        suggestions = _suggestions(spec, settings, setup, layout, budget_bytes, report)
    segments = [(costs.names.index(segment[0]), costs.names.index(segment[-1])) for segment in layout.segments]
    return PlanResult(
        model=spec.name,
        fingerprint=model_fingerprint(model),
        settings=settings.replace(checkpoint=layout),
        budget_bytes=budget_bytes,
        fits=peak <= budget_bytes,
        layout=layout,
        predicted_peak_bytes=peak,
        model_peak_bytes=solution_for(costs, segments).model_peak_bytes,
        recompute_flops=flops,
        step_flops=costs.step_flops,
        solver=chosen_solver,
        candidates=costs.names,
        baselines=tuple(baselines),
        over_budget_bytes=max(0, peak - budget_bytes),
        suggestions=suggestions,
        traces=len(tracer.simulations),
        seconds=time.perf_counter() - started,
    )


def _suggestions(
    spec: ModelSpec,
    settings: TrainingSettings,
    setup: FakeSetup,
    layout: CheckpointLayout,
    budget_bytes: int,
    report: Progress,
) -> tuple[str, ...]:
    """What would fit instead, each checked by tracing: a smaller micro-batch with that layout."""
    suggestions = []

    def trace_at(batch_size: int) -> dict[str, int]:
        report(f"tracing batch size {batch_size} with {layout.describe()}")
        with layout_applied(setup.state.model, layout):
            traced = trace_step(spec, settings.replace(batch_size=batch_size, checkpoint=layout), setup)
        return dict(simulate(traced).phase_peak_bytes)

    batch = settings.batch_size
    if batch > 1:
        known = {batch: trace_at(batch), max(1, batch // 2): trace_at(max(1, batch // 2))}
        fitting = find_max_batch_size(known, trace_at, budget_bytes) if len(known) == 2 else 0
        if fitting >= 1:
            peak = max(known[fitting].values()) if fitting in known else None
            accumulation = -(-batch * settings.grad_accum // fitting)
            suggestions.append(
                f"--batch-size {fitting} with --grad-accum {accumulation} (same effective batch) fits with "
                f"{layout.describe()}" + (f": {format_bytes(peak)}" if peak is not None else "")
            )
        else:
            suggestions.append("not even batch size 1 fits with this checkpointing")
    if settings.precision == "fp32":
        suggestions.append("--precision amp-bf16 or bf16 halves activation and (for bf16) parameter memory")
    if settings.optimizer in ("adam", "adamw"):
        suggestions.append("--optimizer adam8bit or adafactor shrinks optimizer state")
    return tuple(suggestions)
