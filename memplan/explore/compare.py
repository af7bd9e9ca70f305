"""One model, the techniques people try when a step does not fit, each traced and simulated.

Every technique changes the settings given (the base) in one way, or two for the last row. The
cost columns are what the technique trades for memory: recomputation (FLOPs the traced step
spends beyond its non-checkpointed twin), micro-steps per optimizer step (gradient accumulation
keeps the effective batch by running smaller micro-batches), or numerics (lower precision).

Effective batch = micro-batch × gradient accumulation steps × data-parallel GPUs; memory is per
GPU: one rank's (the same on every GPU under DDP; under FSDP2, rank 0's, whose shards are the
largest where a dimension does not divide evenly).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from memplan.distributed.modes import DDP_MODES, DEEPSPEED_MODES, FSDP_MODES
from memplan.errors import SettingsError, TraceError, UsageError
from memplan.estimator.estimate import Progress, run_estimate
from memplan.estimator.result import EstimateResult
from memplan.forked import imap_forked, side_by_side_workers
from memplan.models.source import ModelSpec
from memplan.results import fields_dict
from memplan.settings import TrainingSettings


@dataclass(frozen=True)
class Technique:
    name: str
    changes: dict[str, Any]
    cost: str  # what it trades for memory, in words


def _for_stage_of(parallel: str, base: TrainingSettings) -> str | None:
    """The base's DeepSpeed configuration (JSON text) for a row of another ZeRO stage: its stage left
    to the row's --parallel, the rest (bucket sizes, thresholds) kept."""
    if base.deepspeed_config is None:
        return None
    config = base.deepspeed_settings
    zero = {key: value for key, value in (config.get("zero_optimization") or {}).items() if key != "stage"}
    return json.dumps({**config, "zero_optimization": zero}, sort_keys=True)


def techniques(base: TrainingSettings) -> list[Technique]:
    """The usual list, without the ones the base already uses or that cannot keep its effective batch."""
    found = [Technique("as given", {}, "")]
    for precision, name, cost in (
        ("amp-bf16", "AMP bf16", "numerics: bf16 matmuls"),
        ("amp-fp16", "AMP fp16", "numerics: fp16 matmuls, loss scaling"),
        ("bf16", "pure bf16", "numerics: bf16 weights and updates"),
    ):
        if base.precision != precision:
            found.append(Technique(name, {"precision": precision}, cost))
    for factor in (2, 4):
        if base.batch_size % factor == 0:
            found.append(
                Technique(
                    f"grad accumulation ×{factor}",
                    {"batch_size": base.batch_size // factor, "grad_accum": base.grad_accum * factor},
                    f"{base.grad_accum * factor} micro-steps per optimizer step",
                )
            )
    for optimizer, name, cost in (
        ("adafactor", "Adafactor", "numerics: factored 2nd moment"),
        ("adam8bit", "8-bit Adam", "numerics: 8-bit state (bitsandbytes)"),
    ):
        if base.optimizer != optimizer and not (optimizer == "adafactor" and base.parallel in FSDP_MODES):
            found.append(Technique(name, {"optimizer": optimizer, "optimizer_impl": "default"}, cost))
    if base.lora_rank is not None and base.quantize is None:
        found.append(
            Technique("QLoRA (NF4 base)", {"quantize": "nf4"}, "numerics: 4-bit frozen weights (bitsandbytes)")
        )
    if base.parallel in DDP_MODES and not base.ddp_bucket_view:
        found.append(Technique("DDP gradient_as_bucket_view", {"ddp_bucket_view": True}, "gradients are bucket views"))
    sharding = (
        ("zero1", "ZeRO-1 (optimizer state sharded)", "communication: parameter broadcasts after each step"),
        (
            "fsdp",
            "FSDP2 (reshard after forward)",
            "communication: all-gathers in forward and backward, reduce-scatters",
        ),
        ("fsdp-grad-op", "FSDP2, no reshard after forward", "communication: all-gathers in forward, reduce-scatters"),
        (
            "zero2",
            "DeepSpeed ZeRO-2 (optimizer state and gradients partitioned)",
            "communication: gradient buckets reduced, parameters all-gathered after each step",
        ),
        (
            "zero3",
            "DeepSpeed ZeRO-3 (parameters partitioned too)",
            "communication: parameters gathered for each module's forward and backward, gradient buckets reduced",
        ),
    )
    if base.parallel != "none":  # the same ranks, sharded
        for parallel, name, cost in sharding:
            if base.parallel != parallel:
                # A --deepspeed configuration goes to the other DeepSpeed rows, with their own stage.
                keep = _for_stage_of(parallel, base) if parallel in DEEPSPEED_MODES else None
                overrides = {"parallel": parallel, "ddp_bucket_view": False, "deepspeed_config": keep}
                # Each offload goes to the rows that take it: params to FSDP2's and ZeRO-3's, optimizer to ZeRO's.
                takes = {"params": (*FSDP_MODES, "zero3"), "optimizer": DEEPSPEED_MODES}.get(base.offload, ())
                if base.offload != "none" and parallel not in takes:
                    overrides["offload"] = "none"
                found.append(Technique(name, overrides, cost))
    if base.parallel in FSDP_MODES and base.offload == "none":
        found.append(
            Technique(
                "FSDP2 CPU offload (state in host memory)",
                {"offload": "params"},
                "host memory for shards, gradients and optimizer state; every step copies them over PCIe and runs "
                "the optimizer on the CPU",
            )
        )
    if base.deepspeed_stage == 3 and not base.deepspeed_offloads_parameters:
        found.append(
            Technique(
                "DeepSpeed offload_param + offload_optimizer (parameters and optimizer in host memory)",
                {"offload": "params"},
                "host memory for the parameter partitions, master weights, their gradients and the optimizer "
                "state; every module's parameters copied over PCIe for each gather, the optimizer run on the CPU",
            )
        )
    if base.deepspeed_stage is not None and not base.offloads_to_host:
        found.append(
            Technique(
                "DeepSpeed offload_optimizer (optimizer in host memory)",
                {"offload": "optimizer"},
                "host memory for the master weights, their gradients and the optimizer state; every step copies "
                "the gradients and weights over PCIe and runs the optimizer on the CPU",
            )
        )
    if base.checkpoint == "none":
        found.append(Technique("checkpoint all blocks", {"checkpoint": "all"}, "recompute"))
        if base.precision != "amp-bf16":
            found.append(
                Technique("AMP bf16 + checkpoint all", {"precision": "amp-bf16", "checkpoint": "all"}, "recompute")
            )
    return found


@dataclass(frozen=True)
class CompareRow:
    name: str
    cost: str
    estimate: EstimateResult
    effective_batch_size: int
    recompute_flops: int | None  # checkpointing rows: step FLOPs beyond the same settings without it
    fits: bool | None = None  # with a budget

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "name": self.name,
            "cost": self.cost,
            "settings": e.settings.to_dict(),
            "peak_bytes": e.peak_bytes,
            "reserved_peak_bytes": e.reserved_peak_bytes,
            "smallest_device_bytes": e.smallest_device_bytes,
            "host_peak_bytes": e.host_peak_bytes,  # --offload: the host's share, in none of the above
            "breakdown": e.breakdown.to_dict(),
            "fits": self.fits,
            "effective_batch_size": self.effective_batch_size,
            "micro_steps_per_optimizer_step": e.settings.grad_accum,
            "step_flops": e.step_flops,
            "recompute_flops": self.recompute_flops,
        }


@dataclass(frozen=True)
class CompareResult:
    model: str
    settings: TrainingSettings
    gpus: int
    budget_bytes: int | None
    rows: tuple[CompareRow, ...]
    skipped: tuple[str, ...]  # techniques that do not apply, with the reason
    seconds: float
    interrupted: bool = False  # Ctrl-C stopped it: `rows` are the techniques finished before

    def _repr_html_(self) -> str:
        """Jupyter's view: the CLI's report (memplan.render.notebook)."""
        from memplan.render.explore import render_compare
        from memplan.render.notebook import recorded_html

        return recorded_html(lambda console: render_compare(self, console))

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def _row_estimate(
    spec: ModelSpec, variant: tuple[str, Technique, TrainingSettings | SettingsError], report: Progress | None
) -> EstimateResult | str:
    """One row's estimate, or why its technique cannot apply (the as-given row's mistakes are the user's: raised)."""
    label, technique, settings = variant
    assert isinstance(settings, TrainingSettings)
    try:
        progress = (lambda message: report(f"{label}: {message}")) if report is not None else None
        return run_estimate(spec, settings, progress=progress, per_sample=False)  # (a row shows no slope)
    except (SettingsError, UsageError, TraceError) as error:
        if not technique.changes:
            raise  # the configuration as given is the user's to fix
        # e.g. QLoRA without bitsandbytes, or on a model that is not a transformers model; bf16 weights where the
        # user's batch is float32 (the real step would fail too: memplan.estimator.oprules.dtypes)
        return str(error)


def run_compare(
    spec: ModelSpec,
    settings: TrainingSettings,
    *,
    gpus: int = 1,
    budget_bytes: int | None = None,
    progress: Progress | None = None,
) -> CompareResult:
    started = time.perf_counter()
    if gpus < 1:
        raise SettingsError(f"--gpus must be a positive integer, got {gpus}")
    if settings.parallel != "none":
        # The ranks are --world-size's: the rows are one rank's, the effective batch all ranks'.
        if gpus not in (1, settings.world_size):
            raise SettingsError(
                f"with --parallel {settings.parallel} the GPUs are --world-size's: give --world-size {gpus} instead of "
                f"--gpus {gpus}"
                if settings.world_size == 1  # --world-size left at its default
                else f"--gpus {gpus} and --world-size {settings.world_size} both count data-parallel GPUs: "
                "give --world-size"
            )
        gpus = settings.world_size
    if not isinstance(settings.checkpoint, str):
        raise SettingsError("compare starts from --checkpoint none or all, not a plan file")
    report = progress or (lambda message: None)
    settings = spec.settings_for(settings)
    results: dict[str, EstimateResult] = {}
    rows, skipped = [], []
    listed = techniques(settings)
    entries: list[tuple[str, Technique, TrainingSettings | SettingsError]] = []
    for number, technique in enumerate(listed, start=1):
        label = f"[{number}/{len(listed)}] {technique.name}"
        try:
            entries.append((label, technique, settings.replace(**technique.changes)))
        except SettingsError as error:  # e.g. autocast or accumulation rows with --step
            entries.append((label, technique, error))
    variants = [entry for entry in entries if isinstance(entry[2], TrainingSettings)]
    # Rows side by side in forked workers, one per core (each reports only as it arrives), else one by one
    # here (each reporting its traces as it goes).
    workers = side_by_side_workers(len(variants))
    estimates = imap_forked(
        lambda variant: _row_estimate(spec, variant, None if workers > 1 else report), variants, workers, probed=True
    )
    interrupted = False
    try:
        for label, technique, variant in entries:
            if isinstance(variant, SettingsError):
                skipped.append(f"{technique.name}: {variant}")
                continue
            if workers > 1:
                report(f"{label}: tracing in a forked process")
            outcome = next(estimates)
            if isinstance(outcome, str):  # a technique this model or installation cannot take: said, not fatal
                skipped.append(f"{technique.name}: {outcome}")
                continue
            result = outcome
            if technique.changes.get("checkpoint") == "all" and not result.checkpointed_blocks:
                skipped.append(f"{technique.name}: the model has no repeated blocks to checkpoint")
                continue
            recompute = None
            if variant.checkpoint == "all" and settings.checkpoint == "none":
                same = result.settings.replace(checkpoint="none")
                twin = next((r for r in results.values() if r.settings == same), None)
                twin = twin or run_estimate(spec, variant.replace(checkpoint="none"), per_sample=False)
                recompute = result.step_flops - twin.step_flops
            results[technique.name] = result
            effective = variant.batch_size * variant.grad_accum * gpus
            fits = result.fits_within(budget_bytes) if budget_bytes is not None else None
            rows.append(CompareRow(technique.name, technique.cost, result, effective, recompute, fits))
    except KeyboardInterrupt:
        if not rows:
            raise  # nothing finished to show
        interrupted = True  # keep what is finished; the caller shows it and exits as interrupted
    finally:
        estimates.close()  # stops the workers of rows not needed
    seconds = time.perf_counter() - started
    return CompareResult(spec.name, settings, gpus, budget_bytes, tuple(rows), tuple(skipped), seconds, interrupted)
