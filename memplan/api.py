"""The Python API: one function per job, each returning a frozen result dataclass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memplan.compat import require_supported_torch

require_supported_torch()  # before the imports below, which need a torch memplan knows

from memplan.errors import SettingsError
from memplan.estimator.estimate import Progress, run_estimate
from memplan.estimator.result import EstimateResult
from memplan.explore.compare import CompareResult, run_compare
from memplan.explore.sweep import DEFAULT_BATCH_SIZES, SweepResult, run_sweep
from memplan.gpus import gpu_named
from memplan.models.source import ModelSpec, resolve_model
from memplan.planner.maximize import MaximizeResult, maximize_batch
from memplan.planner.plan import PlanResult, make_plan
from memplan.planner.plan_file import Plan, apply_plan, check_settings, load_plan
from memplan.settings import CHECKPOINT_MODES, TrainingSettings, parse_size
from memplan.validate.result import ValidationResult
from memplan.validate.runner import (
    DEFAULT_TIMEOUT_SECONDS,
    DEFAULT_WARMUP_ITERATIONS,
    check_can_measure,
    validate_config,
)
from memplan.validate.suite import SuiteConfig, run_suite, suite_named

__all__ = ["apply_plan", "compare", "estimate", "plan", "plan_batch", "sweep", "validate", "validate_suite"]


def _settings(settings: TrainingSettings | None, overrides: dict[str, Any]) -> tuple[TrainingSettings, Plan | None]:
    """Settings from a base and keyword overrides; `checkpoint` may also be a plan (file or loaded)."""
    unknown = set(overrides) - set(TrainingSettings.__dataclass_fields__)
    if unknown:
        raise SettingsError(
            f"unknown setting(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(TrainingSettings.__dataclass_fields__)}"
        )
    checkpoint = overrides.get("checkpoint")
    plan = None
    if isinstance(checkpoint, Plan | Path) or (isinstance(checkpoint, str) and checkpoint not in CHECKPOINT_MODES):
        plan = load_plan(checkpoint)
        overrides = {**overrides, "checkpoint": plan.layout}
    return (settings or TrainingSettings()).replace(**overrides), plan


def _budget(budget: str | int | None, settings: TrainingSettings) -> int | None:
    """An explicit budget, else the usable memory of the named GPU, else none."""
    if budget is not None:
        return parse_size(budget)
    return gpu_named(settings.gpu).total_bytes - settings.context_bytes if settings.gpu is not None else None


def _checked_against_plan(spec: ModelSpec, settings: TrainingSettings, plan: Plan | None) -> TrainingSettings:
    settings = spec.settings_for(settings)
    if plan is not None:
        check_settings(plan, settings)
    return settings


def estimate(
    model: str,
    settings: TrainingSettings | None = None,
    *,
    inputs: str | None = None,
    loss: str | None = None,
    task: str | None = None,
    budget: str | int | None = None,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> EstimateResult:
    """Predict the peak memory of one steady-state training iteration of `model`.

    `model` is a preset name, a transformers model type, a config.json or model directory, a cached
    hub id, or `package.module:callable`. Settings come from `settings` and/or keyword overrides
    (`batch_size=8, precision="amp-bf16", ...`); `checkpoint` is "none", "all", a `CheckpointLayout`
    or a plan file from `plan` (refused if made for another model or other settings). With `budget`
    ("24GiB", "80GB", bytes), or a `gpu` name and no budget (its usable memory), the result says
    whether the configuration fits and the largest batch size that does.
    """
    settings, loaded = _settings(settings, setting_overrides)
    spec = resolve_model(model, inputs=inputs, loss=loss, task=task)
    settings = _checked_against_plan(spec, settings, loaded)
    budget_bytes = _budget(budget, settings)
    return run_estimate(
        spec,
        settings,
        budget_bytes=budget_bytes,
        progress=progress,
        plan_fingerprint=loaded.fingerprint if loaded is not None else None,
    )


def sweep(
    model: str,
    settings: TrainingSettings | None = None,
    *,
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    precisions: tuple[str, ...] | None = None,
    checkpoints: tuple[str, ...] | None = None,
    budget: str | int | None = None,
    inputs: str | None = None,
    loss: str | None = None,
    task: str | None = None,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> SweepResult:
    """Predicted peak at each of `batch_sizes` for every precision × checkpoint mode given.

    `precisions` and `checkpoints` default to the settings' own; with `budget` (or a `gpu`), each
    series also gets the largest batch size that fits.
    """
    settings, _ = _settings(settings, setting_overrides)
    spec = resolve_model(model, inputs=inputs, loss=loss, task=task)
    return run_sweep(
        spec,
        settings,
        batch_sizes=tuple(batch_sizes),
        precisions=tuple(precisions) if precisions else None,
        checkpoints=tuple(checkpoints) if checkpoints else None,
        budget_bytes=_budget(budget, settings),
        progress=progress,
    )


def compare(
    model: str,
    settings: TrainingSettings | None = None,
    *,
    gpus: int = 1,
    budget: str | int | None = None,
    inputs: str | None = None,
    loss: str | None = None,
    task: str | None = None,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> CompareResult:
    """The usual memory-saving techniques applied one at a time to the settings, each predicted.

    Rows: as given, AMP bf16/fp16, pure bf16, gradient accumulation ×2/×4 at the same effective
    batch, Adafactor, 8-bit Adam, checkpointing every block, and AMP bf16 with checkpointing;
    `gpus` (data-parallel replicas) only multiplies the effective batch.
    """
    settings, _ = _settings(settings, setting_overrides)
    spec = resolve_model(model, inputs=inputs, loss=loss, task=task)
    return run_compare(spec, settings, gpus=gpus, budget_bytes=_budget(budget, settings), progress=progress)


def plan(
    model: str,
    settings: TrainingSettings | None = None,
    *,
    budget: str | int | None = None,
    inputs: str | None = None,
    loss: str | None = None,
    task: str | None = None,
    candidates: str | None = None,
    solver: str = "auto",
    selective: bool = False,
    jobs: int | None = None,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> PlanResult:
    """The checkpointing plan with the least recomputation whose simulated peak fits `budget`.

    `candidates` is a regex over qualified module names (default: every block of every repeated
    `nn.ModuleList`); `solver` is "auto", "dp" (exact on the chain cost model) or "greedy";
    `selective` also offers selective checkpointing of every candidate (one more trace); `jobs`:
    how many processes trace the layouts at once (default: one per available core). Write
    the result with `memplan.planner.plan_file.write_plan` and use it with `apply_plan`.
    """
    spec, settings, budget_bytes = _plan_inputs(model, settings, budget, inputs, loss, task, setting_overrides)
    return make_plan(
        spec,
        settings,
        budget_bytes,
        candidates=candidates,
        solver=solver,
        progress=progress,
        selective=selective,
        jobs=jobs,
    )


def _plan_inputs(
    model: str,
    settings: TrainingSettings | None,
    budget: str | int | None,
    inputs: str | None,
    loss: str | None,
    task: str | None,
    overrides: dict[str, Any],
) -> tuple[ModelSpec, TrainingSettings, int]:
    settings, _ = _settings(settings, {**overrides, "checkpoint": "none"})
    budget_bytes = _budget(budget, settings)
    if budget_bytes is None:
        raise SettingsError("a plan needs a budget: pass --budget (e.g. 24GiB) or --gpu NAME")
    return resolve_model(model, inputs=inputs, loss=loss, task=task), settings, budget_bytes


def plan_batch(
    model: str,
    settings: TrainingSettings | None = None,
    *,
    budget: str | int | None = None,
    inputs: str | None = None,
    loss: str | None = None,
    task: str | None = None,
    candidates: str | None = None,
    solver: str = "auto",
    jobs: int | None = None,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> MaximizeResult:
    """The micro-batch and checkpointing plan with the best roofline throughput within `budget`.

    Plans batch sizes from the largest that fits without checkpointing to the largest that fits
    with every block checkpointed; each option is a traced, fitting plan (`.best.plan` can be
    written with `write_plan`). cuda targets only: the ranking needs the card's time estimate.
    """
    spec, settings, budget_bytes = _plan_inputs(model, settings, budget, inputs, loss, task, setting_overrides)
    return maximize_batch(
        spec, settings, budget_bytes, candidates=candidates, solver=solver, progress=progress, jobs=jobs
    )


def validate(
    model: str,
    settings: TrainingSettings | None = None,
    *,
    inputs: str | None = None,
    loss: str | None = None,
    task: str | None = None,
    warmup: int = DEFAULT_WARMUP_ITERATIONS,
    snapshot: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_SECONDS,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> ValidationResult:
    """Predict one configuration, run it for real in a subprocess, and compare.

    On cuda the run is measured with torch.cuda.max_memory_allocated / max_memory_reserved after
    `warmup` iterations; on cpu with memplan's live-storage counter. An out-of-memory run is a
    result (`out_of_memory=True`), not an exception. `snapshot` (cuda) saves PyTorch's memory
    snapshot of the measured iteration for memory_viz.
    """
    settings, loaded = _settings(settings, setting_overrides)
    check_can_measure(settings.device, snapshot)
    spec = resolve_model(model, inputs=inputs, loss=loss, task=task)
    settings = _checked_against_plan(spec, settings, loaded)
    return validate_config(
        spec,
        settings,
        warmup=warmup,
        snapshot=snapshot,
        timeout_s=timeout_s,
        plan_fingerprint=loaded.fingerprint if loaded is not None else None,
        progress=progress,
    )


def validate_suite(
    name: str,
    results: str | Path,
    *,
    device: str = "cuda",
    resume: bool = False,
    warmup: int = DEFAULT_WARMUP_ITERATIONS,
    timeout_s: float = DEFAULT_TIMEOUT_SECONDS,
) -> Iterator[tuple[SuiteConfig, ValidationResult | None]]:
    """Validate every configuration of a built-in suite, appending each result to `results` as it goes.

    Yields (configuration, result) as each finishes; the result is None for configurations a
    resumed run finds already in the file.
    """
    configs = suite_named(name)

    def measure(config: SuiteConfig) -> ValidationResult:
        return validate(config.model, warmup=warmup, timeout_s=timeout_s, device=device, **config.settings)

    return run_suite(name, configs, Path(results), measure, device=device, resume=resume)
