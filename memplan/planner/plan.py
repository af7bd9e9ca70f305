"""Settings + model + byte budget -> the least-recompute checkpointing plan that fits, proven by re-tracing.

1. Trace the step without checkpointing; read each candidate's freed bytes and FLOPs off it.
2. Solve on the cost model (exact DP for chains, greedy for very long ones).
3. Re-trace the step with the solution applied and simulate it: that peak is the prediction. If it
   is over budget (the model is an approximation), tighten the solver's budget by the overshoot
   and solve again.
4. Trace the baselines the same way, and when nothing fits, say by how much and what would.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memplan.checkpoint_layout import CheckpointLayout
from memplan.errors import SettingsError
from memplan.estimator.checkpointing import block_names, uncalled_containers
from memplan.estimator.cuda.allocator import ROUND_LARGE_BYTES
from memplan.estimator.liveness import liveness
from memplan.estimator.search import find_max_batch_size
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import FakeSetup, build_fake_setup
from memplan.forked import available_cores
from memplan.models.fingerprint import model_fingerprint
from memplan.models.source import ModelSpec
from memplan.planner.costs import ChainCosts, chain_costs, select_candidates
from memplan.planner.layout_tracer import LayoutTracer, PlanOption
from memplan.planner.solvers import Solution, dp, greedy, solution_for
from memplan.planner.solvers.baselines import BASELINES, all_blocks
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes

SOLVERS: dict[str, Callable[[ChainCosts, int], Solution | None]] = {"dp": dp.solve, "greedy": greedy.solve}
# Above this many candidates "auto" uses the greedy heuristic (the DP's front grows with the chain).
DP_MAX_CANDIDATES = 128
VERIFY_ROUNDS = 4
SELECTIVE_OPTION = "all blocks, selective"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PlanResult:
    model: str
    fingerprint: str
    settings: TrainingSettings  # with checkpoint = the chosen layout
    budget_bytes: int
    fits: bool
    layout: CheckpointLayout  # the plan when it fits; else the layout that came closest
    predicted_peak_bytes: int  # simulated peak of the re-traced, planned step
    model_peak_bytes: int  # what the solver's cost model said (it models full checkpoints only)
    recompute_flops: int
    step_flops: int  # forward + backward + optimizer without checkpointing
    solver: str
    candidates: tuple[str, ...]
    baselines: tuple[PlanOption, ...]
    over_budget_bytes: int  # 0 when it fits
    suggestions: tuple[str, ...]
    traces: int
    seconds: float
    reserved_peak_bytes: int | None = None  # cuda: the planned step's reserved peak
    smallest_device_bytes: int | None = None  # cuda: the least memory it completes in, what the budget holds
    step_seconds: float | None = None  # cuda: roofline time of the planned step on the card (a lower bound)
    recompute_seconds: float | None = None  # cuda: what the recomputation adds to it
    # How the model was named besides `model` (--inputs, --loss, --task): a plan's step is theirs too
    inputs: str | None = None
    loss: str | None = None
    task: str | None = None

    def _repr_html_(self) -> str:
        """Jupyter's view: the CLI's report (memplan.render.notebook)."""
        from memplan.render.notebook import recorded_html
        from memplan.render.plan import render_plan

        return recorded_html(lambda console: render_plan(self, console))

    def to_dict(self) -> dict[str, Any]:
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data.update(
            settings=self.settings.to_dict(),
            layout=self.layout.to_dict(),
            candidates=list(self.candidates),
            baselines=[option.to_dict() for option in self.baselines],
            suggestions=list(self.suggestions),
            seconds=round(self.seconds, 3),
        )
        return data


def layout_of(costs: ChainCosts, segments: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> CheckpointLayout:
    return CheckpointLayout(segments=tuple(tuple(costs.names[a : b + 1]) for a, b in segments))


def _overshoot(fit_bytes: int, budget_bytes: int) -> int:
    """How far a step that does not fit is over the budget: its figure's excess, or, where the
    figure is within the budget but the replay at the budget ran out (the retry is not monotone in
    capacity), one 2 MiB segment step."""
    return fit_bytes - budget_bytes if fit_bytes > budget_bytes else ROUND_LARGE_BYTES


def _solve_verified(
    costs: ChainCosts, solve: Callable[[ChainCosts, int], Solution | None], tracer: LayoutTracer, budget_bytes: int
) -> tuple[Solution, int] | None:
    target = budget_bytes
    for _ in range(VERIFY_ROUNDS):
        solution = solve(costs, target)
        if solution is None:
            return None
        layout = layout_of(costs, solution.segments)
        if tracer.fits(layout, budget_bytes):
            return solution, tracer.peak(layout)
        # The model was optimistic here by at least this much (a segment step where the figure
        # itself is within the budget but the budget's own replay runs out).
        target -= _overshoot(tracer.fit_bytes(layout), budget_bytes)
    return None


def make_plan(
    spec: ModelSpec,
    settings: TrainingSettings,
    budget_bytes: int,
    *,
    candidates: str | None = None,
    solver: str = "auto",
    progress: Progress | None = None,
    setup: FakeSetup | None = None,
    selective: bool = False,
    jobs: int | None = None,
) -> PlanResult:
    """`setup`: a fake model already built for these settings without checkpointing (any batch size).

    `selective`: also trace every candidate under selective checkpointing (SELECTIVE_OPTION), an
    option beside the baselines; the solver itself places full checkpoints only.

    `jobs`: how many processes trace layouts at once (default: one per available core; 1 traces
    everything in this process).
    """
    started = time.perf_counter()
    report = progress or (lambda message: None)
    if solver not in ("auto", *SOLVERS):
        raise SettingsError(f"solver must be auto, {', '.join(SOLVERS)}; got {solver!r}")
    settings = spec.settings_for(settings).replace(checkpoint="none")
    if setup is None:
        report("building the model under fake tensors")
        setup = build_fake_setup(spec, settings)
    model = setup.state.built_model
    names = select_candidates(
        [name for name, _ in model.named_modules()], block_names(model), candidates, uncalled_containers(model)
    )
    if not names:
        raise SettingsError(
            f"{spec.name} has no repeated blocks (an nn.ModuleList of same-class modules or of transformers' layers, "
            "an nn.Sequential's composite children of one class) to checkpoint; name candidate modules with "
            "--candidates REGEX"
        )
    tracer = LayoutTracer(spec, settings, setup, report, available_cores() if jobs is None else jobs)
    report("tracing without checkpointing")
    traced = tracer.trace(CheckpointLayout(), settings.batch_size)
    lifetimes = liveness(traced)
    base_simulation = tracer.record(CheckpointLayout(), traced, lifetimes)
    costs = chain_costs(traced, lifetimes, base_simulation, names)
    chosen_solver = solver if solver != "auto" else ("dp" if len(costs) <= DP_MAX_CANDIDATES else "greedy")
    report(f"solving over {len(costs)} candidates ({chosen_solver})")
    baseline_segments = {name: strategy(costs) for name, strategy in BASELINES.items()}
    baseline_layouts = {name: layout_of(costs, segments) for name, segments in baseline_segments.items()}
    if selective:
        every = all_blocks(costs)
        baseline_layouts[SELECTIVE_OPTION] = dataclasses.replace(
            layout_of(costs, every), policies=("selective",) * len(every)
        )
    # The first answer, checked below, and every baseline are traced at once: they are independent.
    first = SOLVERS[chosen_solver](costs, budget_bytes)
    answer = [layout_of(costs, first.segments)] if first is not None else []
    tracer.prefetch(answer + list(baseline_layouts.values()))
    found = _solve_verified(costs, SOLVERS[chosen_solver], tracer, budget_bytes)

    baselines = []
    for name in baseline_segments:
        layout = baseline_layouts[name]
        baselines.append(tracer.option(name, layout, tracer.recompute_flops(layout), budget_bytes))
    if selective:
        layout = baseline_layouts[SELECTIVE_OPTION]
        baselines.append(tracer.option(SELECTIVE_OPTION, layout, tracer.recompute_flops(layout), budget_bytes))

    # The cost model may rank two layouts differently from their simulations (or, budgeting the
    # reserved peak on cuda, miss what fits): of everything traced that fits, keep the least
    # recompute, then the lowest peak.
    options = [(o.recompute_flops, o.predicted_peak_bytes, o.layout) for o in baselines if o.fits]
    if found is not None:
        solution, peak = found
        solved = layout_of(costs, solution.segments)
        options.append((tracer.recompute_flops(solved), peak, solved))
    suggestions: tuple[str, ...] = ()
    if options:
        # No checkpoint recomputes nothing: where the step fits as it is, that is the plan, whatever the FLOP
        # count says (a selective checkpoint recomputes ops flop_counter gives no FLOPs: it would tie at 0).
        flops, peak, layout = min(
            options,
            key=lambda option: (bool(option[2].segments), _recompute_cost(tracer, option[2], selective), *option[:2]),
        )
    else:
        closest = min(baselines, key=lambda option: tracer.fit_bytes(option.layout))
        layout, peak, flops = closest.layout, closest.predicted_peak_bytes, closest.recompute_flops
        suggestions = _suggestions(tracer, layout, budget_bytes)
    segments = [(costs.names.index(segment[0]), costs.names.index(segment[-1])) for segment in layout.segments]
    return PlanResult(
        model=spec.name,
        inputs=spec.ref.inputs,
        loss=spec.ref.loss,
        task=spec.ref.task,
        fingerprint=model_fingerprint(model),
        settings=settings.replace(checkpoint=layout),
        budget_bytes=budget_bytes,
        fits=tracer.fits(layout, budget_bytes),
        layout=layout,
        predicted_peak_bytes=peak,
        model_peak_bytes=solution_for(costs, segments).model_peak_bytes,
        recompute_flops=flops,
        step_flops=costs.step_flops,
        solver=chosen_solver,
        candidates=costs.names,
        baselines=tuple(baselines),
        over_budget_bytes=0
        if tracer.fits(layout, budget_bytes)
        else _overshoot(tracer.fit_bytes(layout), budget_bytes),
        suggestions=suggestions,
        traces=tracer.traces,
        seconds=time.perf_counter() - started,
        reserved_peak_bytes=tracer.simulation(layout).reserved_peak_bytes,
        smallest_device_bytes=tracer.simulation(layout).smallest_device_bytes,
        step_seconds=tracer.step_seconds[layout],
        recompute_seconds=tracer.recompute_seconds(layout),
    )


def _recompute_cost(tracer: LayoutTracer, layout: CheckpointLayout, selective: bool) -> float:
    """What ranks fitting layouts before FLOPs: with --selective on a cuda target, the roofline time.

    FLOPs cannot compare the policies: selective checkpointing recomputes pointwise ops,
    normalizations and softmaxes, which flop_counter gives no FLOPs, so it would look free. On
    gpt2 (batch 8, seq 1024, amp-bf16, A10G) it recomputes 0 FLOPs for +45 ms, where checkpointing
    every 2nd block recomputes 0.85 TFLOP for +29 ms. On cpu there is no time model: FLOPs rank.
    """
    seconds = tracer.recompute_seconds(layout) if selective else None
    return seconds if seconds is not None else 0.0


def _suggestions(tracer: LayoutTracer, layout: CheckpointLayout, budget_bytes: int) -> tuple[str, ...]:
    """What would fit instead: a smaller micro-batch with `layout`, found by tracing; untraced hints after it."""
    settings = tracer.settings
    suggestions = []

    def trace_at(batch_size: int) -> dict[str, int]:
        tracer.report(f"tracing batch size {batch_size} with {layout.describe()}")
        return simulate(tracer.trace(layout, batch_size)).fit_phase_peaks

    batch = settings.batch_size
    if batch > 1:
        known = {batch: tracer.simulations[layout].fit_phase_peaks, batch // 2: trace_at(batch // 2)}
        fitting = find_max_batch_size(known, trace_at, budget_bytes)
        if fitting >= 1:
            # the largest micro-batch that fits and divides the effective batch, so that it stays the same
            effective = batch * settings.grad_accum
            micro = next(size for size in range(fitting, 0, -1) if effective % size == 0)
            if micro not in known:
                known[micro] = trace_at(micro)
            suggestions.append(
                f"--batch-size {micro} with --grad-accum {effective // micro} (same effective batch, {effective}) "
                f"fits with {layout.describe()}: {format_bytes(max(known[micro].values()))}"
            )
        else:
            # Each suggestion is something to try (rendered after "try"): here no batch size is.
            suggestions.append("a larger budget or GPU: not even batch size 1 fits with this checkpointing")
    if settings.precision == "fp32":
        suggestions.append("(not traced) --precision amp-bf16 or bf16, which store activations in 16 bits")
    if settings.optimizer in ("adam", "adamw"):
        suggestions.append("(not traced) --optimizer adam8bit or adafactor, which keep less optimizer state")
    return tuple(suggestions)
