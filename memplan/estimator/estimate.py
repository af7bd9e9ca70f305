"""Settings + model source -> traces -> simulations -> EstimateResult."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from memplan.errors import PlanFileError, SettingsError
from memplan.estimator.adam8bit import paged_state_bytes
from memplan.estimator.batch_tracer import (
    BatchTracer,
    Progress,
    confirming_batch_size,
    longest_seq_len,
    second_batch_size,
)
from memplan.estimator.checkpointing import LayoutModuleMissing, unsupported_checkpointing_notes
from memplan.estimator.compiled import compiled_modules_notes
from memplan.estimator.cuda.roofline import step_seconds
from memplan.estimator.flops import node_flops
from memplan.estimator.notes import (
    onednn_convolution_notes,
    settings_notes,
    unchecked_blocks_notes,
    value_dependent_kernel_notes,
)
from memplan.estimator.optimizers import local_optimizer
from memplan.estimator.result import Breakdown, EstimateResult
from memplan.estimator.search import MAX_BATCH_SIZE
from memplan.estimator.traced_step import TracedStep
from memplan.models.fingerprint import check_fingerprint
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["BatchTracer", "Progress", "run_estimate", "second_batch_size", "step_flops"]


def _paged_bytes(optimizer: Optimizer | None) -> int:
    """paged-adam8bit's state in unified memory: that of the parameters this rank updates (under
    --parallel zero1 its share, not the model's)."""
    local = local_optimizer(optimizer) if optimizer is not None else None
    if not getattr(local, "paged", False):
        return 0
    return paged_state_bytes([param for group in local.param_groups for param in group["params"]])


def step_flops(traced: TracedStep) -> int:
    """FLOPs of the traced iteration (torch.utils.flop_counter's formulas; recomputation included)."""
    return sum(node_flops(node) for node in traced.graph.nodes)


def run_estimate(
    spec: ModelSpec,
    settings: TrainingSettings,
    *,
    budget_bytes: int | None = None,
    progress: Progress | None = None,
    plan_fingerprint: str | None = None,
    maximize_seq_len: bool = False,
    per_sample: bool = True,
) -> EstimateResult:
    """`maximize_seq_len` (with a budget): also the longest sequence that fits at the batch size. `per_sample=False`
    (without a budget): one trace, at the batch size, and no per-sample slope, for callers that show none."""
    started = time.perf_counter()
    settings = spec.settings_for(settings)
    if maximize_seq_len and budget_bytes is None:
        raise SettingsError("--maximize seq-len needs a budget: pass --budget (e.g. 24GiB) or --gpu NAME")
    if maximize_seq_len and settings.seq_len is None:
        raise SettingsError(f"--maximize seq-len: {spec.name} takes no sequence length (--seq-len)")
    try:
        tracer = BatchTracer(spec, settings, progress)
    except LayoutModuleMissing as missing:
        if plan_fingerprint is None:
            raise
        # The plan's layout is applied as the model is built, before its fingerprint can be compared.
        raise PlanFileError(
            f"the plan was made for another model (fingerprint {plan_fingerprint}): {missing}; make a plan for "
            "this model with `memplan plan`"
        ) from None
    try:
        return _estimate(
            tracer, spec, settings, budget_bytes, plan_fingerprint, maximize_seq_len, started,
            per_sample or budget_bytes is not None,
        )  # fmt: skip
    finally:
        tracer.close()


def _estimate(
    tracer: BatchTracer,
    spec: ModelSpec,
    settings: TrainingSettings,
    budget_bytes: int | None,
    plan_fingerprint: str | None,
    maximize_seq_len: bool,
    started: float,
    per_sample: bool,
) -> EstimateResult:
    if plan_fingerprint is not None:
        check_fingerprint(plan_fingerprint, "another model", tracer.setup.state.built_model, spec.name)
    simulations = tracer.simulations
    batch_size = settings.batch_size
    # The slope's batch size beside the first trace; a budget's search reads its least device memory too.
    if per_sample:
        tracer.trace_aside(second_batch_size(batch_size), device_fit=budget_bytes is not None)
    if budget_bytes is not None and (confirming := confirming_batch_size(batch_size)) is not None:
        tracer.confirm_aside(confirming)  # the search's lines confirmed beside the first trace, not after it
    main = tracer.simulate(batch_size)
    traced = tracer.first
    assert traced is not None
    _ = main.smallest_device_bytes  # the result's, found while the forked trace may still run, not after it
    slope = None
    if per_sample:
        other = tracer.slope_batch_size()
        slope = (main.peak_bytes - tracer.simulate(other).phase_peak_bytes[main.phase]) // (batch_size - other)
    max_batch = fits = None
    if budget_bytes is not None:
        fits = tracer.fits(settings.batch_size, budget_bytes)
        max_batch = tracer.max_batch_size(budget_bytes)
    max_seq_len, max_seq_len_is_limit, seq_len_traces = None, False, 0
    if maximize_seq_len and budget_bytes is not None:
        max_seq_len, max_seq_len_is_limit, seq_len_traces = longest_seq_len(tracer, budget_bytes)
    all_traced = [*simulations.values(), *tracer.confirming.values()]
    unsupported = sorted({op for simulation in all_traced for op in simulation.unsupported_ops})
    paged = _paged_bytes(tracer.setup.state.optimizer)
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
        allocated_peak_bytes=main.allocated_peak_bytes,
        conv_workspace_free_peak_bytes=main.conv_workspace_free_peak_bytes,
        conv_workspace_free_reserved_peak_bytes=main.conv_workspace_free_reserved_peak_bytes,
        roofline_step_seconds=step_seconds(traced),
        device_peak_bytes=main.reserved_peak_bytes + settings.outside_allocator_bytes
        if main.reserved_peak_bytes is not None
        else None,
        communicator_low_bytes=band[0] if (band := settings.communicator_band_bytes) is not None else None,
        communicator_bytes=band[1] if band is not None else None,
        smallest_device_bytes=main.smallest_device_bytes,
        per_sample_activation_bytes=slope,
        fixed_bytes=main.peak_bytes - slope * batch_size if slope is not None else None,
        parameter_count=traced.parameter_count,
        trainable_parameter_count=traced.trainable_parameter_count,
        checkpointed_blocks=tuple(traced.checkpointed_blocks),
        unsupported_ops=tuple(unsupported),
        graph_nodes=len(traced.graph.nodes),
        step_flops=step_flops(traced),
        traces=len(all_traced) + seq_len_traces,
        interpolated_batch_sizes=len(tracer.interpolated_timelines),
        seconds=time.perf_counter() - started,
        budget_bytes=budget_bytes,
        fits=fits,
        max_batch_size=max_batch,
        max_batch_size_is_limit=max_batch == MAX_BATCH_SIZE,
        max_seq_len=max_seq_len,
        max_seq_len_is_limit=max_seq_len_is_limit,
        paged_optimizer_bytes=paged,
        host_peak_bytes=main.host_peak_bytes,
        notes=tuple(
            list(spec.notes)
            + settings_notes(settings, main.conv_workspace_free_peak_bytes is not None, paged)
            + unchecked_blocks_notes(settings, traced.checkpointed_blocks)
            + unsupported_checkpointing_notes(
                tracer.setup.state.built_model, settings.checkpoint, list(traced.checkpointed_blocks)
            )
            + value_dependent_kernel_notes(traced.graph)
            + onednn_convolution_notes(traced.graph, settings)
            + compiled_modules_notes(tracer.setup.state.built_model)
        ),
        timeline=main.timeline,
    )
