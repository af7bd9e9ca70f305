"""Settings + model source -> traces -> simulations -> EstimateResult."""

from __future__ import annotations

import time
from collections.abc import Callable

from memplan.estimator.result import Breakdown, EstimateResult
from memplan.estimator.search import find_max_batch_size
from memplan.estimator.simulate import Simulation, simulate
from memplan.estimator.trace import build_fake_setup, trace_step
from memplan.gpus import CONTEXT_BYTES, DEFAULT_GPU
from memplan.models.fingerprint import check_fingerprint
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings

Progress = Callable[[str], None]


def _notes(settings: TrainingSettings) -> list[str]:
    notes = []
    if settings.device == "cuda":
        notes.append(
            f"cuda target ({settings.gpu or DEFAULT_GPU}): CUDA's autocast lists, SDPA backend, fused dropout, "
            "cuBLAS workspaces and the caching allocator are emulated; cuDNN convolution workspaces are not "
            "counted, and the CUDA context in device_peak_bytes is an estimate (memplan.gpus.CONTEXT_BYTES)"
        )
    if settings.optimizer == "adam8bit":
        notes.append("adam8bit: bitsandbytes' state layout (uint8 moments + blockwise absmax), in-place update")
    return notes


def second_batch_size(batch_size: int) -> int:
    """The other batch size traced to measure the per-sample slope."""
    return batch_size // 2 if batch_size >= 2 else 2


def run_estimate(
    spec: ModelSpec,
    settings: TrainingSettings,
    *,
    budget_bytes: int | None = None,
    progress: Progress | None = None,
    plan_fingerprint: str | None = None,
) -> EstimateResult:
    started = time.perf_counter()
    settings = spec.settings_for(settings)
    report = progress or (lambda message: None)
    simulations: dict[int, Simulation] = {}
    first = {}
    report("building the model under fake tensors")
    setup = build_fake_setup(spec, settings)
    if plan_fingerprint is not None:
        check_fingerprint(plan_fingerprint, "another model", setup.state.model, spec.name)

    def trace_at(batch_size: int) -> dict[str, int]:
        report(f"tracing batch size {batch_size}")
        traced = trace_step(spec, settings.replace(batch_size=batch_size), setup)
        simulation = simulate(traced)
        simulations[batch_size] = simulation
        if not first:
            first.update(
                nodes=len(traced.graph.graph.nodes),
                parameters=traced.parameter_count,
                trainable=traced.trainable_parameter_count,
                blocks=tuple(traced.checkpointed_blocks),
            )
        return simulation.phase_peak_bytes

    batch_size = settings.batch_size
    known = {batch_size: trace_at(batch_size)}
    other = second_batch_size(batch_size)
    known[other] = trace_at(other)
    main = simulations[batch_size]
    slope = (main.peak_bytes - known[other][main.phase]) // (batch_size - other)
    max_batch = fits = None
    if budget_bytes is not None:
        fits = main.peak_bytes <= budget_bytes
        max_batch = find_max_batch_size(dict(known), trace_at, budget_bytes)
    unsupported = sorted({op for simulation in simulations.values() for op in simulation.unsupported_ops})
    return EstimateResult(
        model=spec.name,
        settings=settings,
        peak_bytes=main.peak_bytes,
        breakdown=Breakdown(**main.breakdown),
        phase=main.phase,
        peak_op=main.peak_op,
        peak_module=main.peak_module,
        phase_peak_bytes=dict(main.phase_peak_bytes),
        reserved_peak_bytes=main.reserved_peak_bytes,
        device_peak_bytes=main.reserved_peak_bytes + CONTEXT_BYTES if main.reserved_peak_bytes is not None else None,
        per_sample_activation_bytes=slope,
        fixed_bytes=main.peak_bytes - slope * batch_size,
        parameter_count=first["parameters"],
        trainable_parameter_count=first["trainable"],
        checkpointed_blocks=first["blocks"],
        unsupported_ops=tuple(unsupported),
        graph_nodes=first["nodes"],
        traces=len(simulations),
        seconds=time.perf_counter() - started,
        budget_bytes=budget_bytes,
        fits=fits,
        max_batch_size=max_batch,
        notes=tuple(_notes(settings)),
        timeline=main.timeline,
    )
