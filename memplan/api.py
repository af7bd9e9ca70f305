"""The Python API: one function per job, each returning a frozen result dataclass."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memplan.compat import require_supported_torch
from memplan.distributed.fake_group import leaves_no_process_group
from memplan.estimator.collector import spares_existing_objects

require_supported_torch()  # before the imports below, which need a torch memplan knows

from memplan.api_arguments import (
    batch_size_tuple,
    budget_in_bytes,
    checked_progress,
    model_source,
    name_tuple,
    plan_inputs,
    positive_count,
    run_limits,
    settings_for_plan,
    settings_from,
)
from memplan.api_terms import speaks_api_terms
from memplan.errors import SettingsError, UsageError
from memplan.estimator.estimate import Progress, run_estimate
from memplan.estimator.result import EstimateResult
from memplan.explore.compare import CompareResult, run_compare
from memplan.explore.gpus import GpuChoiceResult, run_gpu_choice
from memplan.explore.sweep import DEFAULT_BATCH_SIZES, SweepResult, run_sweep
from memplan.models.objects import is_model_object
from memplan.planner.maximize import MaximizeResult, maximize_batch
from memplan.planner.plan import PlanResult, make_plan
from memplan.planner.plan_file import apply_plan as _apply_plan
from memplan.settings import PRECISIONS, TrainingSettings
from memplan.validate.result import ValidationResult
from memplan.validate.runner import (
    DEFAULT_TIMEOUT_SECONDS,
    DEFAULT_WARMUP_ITERATIONS,
    check_can_measure,
    validate_config,
)
from memplan.validate.suite import SUITES, SuiteConfig, run_suite, suite_named

apply_plan = speaks_api_terms(_apply_plan)

__all__ = [
    "apply_plan",
    "compare",
    "estimate",
    "plan",
    "plan_batch",
    "sweep",
    "validate",
    "validate_suite",
    "which_gpu",
]


@speaks_api_terms
@leaves_no_process_group
@spares_existing_objects
def estimate(
    model: str,
    settings: TrainingSettings | None = None,
    *,
    inputs: str | None = None,
    loss: str | None = None,
    task: str | None = None,
    budget: str | int | None = None,
    maximize: str | None = None,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> EstimateResult:
    """Predict the peak memory of one steady-state training iteration of `model`.

    `model` is a preset name, a transformers model type, a config.json or model directory, a cached
    hub id, or `package.module:callable`. Settings come from `settings` and/or keyword overrides
    (`batch_size=8, precision="amp-bf16", ...`); `checkpoint` is "none", "all", a `CheckpointLayout`
    or a plan file from `plan` (refused if made for another model or other settings). With `budget`
    ("24GiB", "80GB", bytes), or a `gpu` name and no budget (its usable memory), the result says
    whether the configuration fits and the largest batch size that does; `maximize="seq-len"` adds the
    longest sequence length that fits at the batch size (`max_seq_len`).
    """
    if maximize not in (None, "seq-len"):
        raise SettingsError(f"maximize must be 'seq-len' or None; got {maximize!r}")
    settings, loaded = settings_from(settings, setting_overrides, inputs)
    spec = model_source(model, inputs, loss, task)
    settings = settings_for_plan(spec, settings, loaded)
    budget_bytes = budget_in_bytes(budget, settings)
    return run_estimate(
        spec,
        settings,
        budget_bytes=budget_bytes,
        progress=checked_progress(progress),
        plan_fingerprint=loaded.fingerprint if loaded is not None else None,
        maximize_seq_len=maximize == "seq-len",
    )


@speaks_api_terms
@leaves_no_process_group
@spares_existing_objects
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
    # A batch size other than the default (which the CLI passes on) would be ignored, and the result's settings
    # would still show it.
    if setting_overrides.get("batch_size", TrainingSettings.batch_size) != TrainingSettings.batch_size:
        raise UsageError(
            "sweep traces batch_sizes (e.g. batch_sizes=(1, 2, 4, 8)); batch_size is for one configuration"
        )
    precisions = name_tuple(precisions, "precisions")
    if precisions and settings is None and precisions[0] in PRECISIONS:
        # Each series runs one of `precisions`, and --precision only names the default: the settings are checked
        # (against a DeepSpeed file's precision, say) with the first of them.
        setting_overrides = {**setting_overrides, "precision": precisions[0]}
    settings, _ = settings_from(settings, setting_overrides, inputs)
    sizes = batch_size_tuple(batch_sizes)
    checkpoints = name_tuple(checkpoints, "checkpoints")
    spec = model_source(model, inputs, loss, task)
    return run_sweep(
        spec,
        settings,
        batch_sizes=sizes,
        precisions=precisions,
        checkpoints=checkpoints,
        budget_bytes=budget_in_bytes(budget, settings),
        progress=checked_progress(progress),
    )


@speaks_api_terms
@leaves_no_process_group
@spares_existing_objects
def which_gpu(
    model: Any,
    gpus: str | list[str] | tuple[str, ...],
    settings: TrainingSettings | None = None,
    *,
    inputs: Any = None,
    loss: str | None = None,
    task: str | None = None,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> GpuChoiceResult:
    """The same configuration estimated on each card of `gpus` (names, or one comma-separated
    string): whether it fits the card's usable memory, the largest batch that does, and the card's
    listed price per hour where memplan.prices has one. `result.cheapest` is the fitting card with
    the lowest listed price. Each card is its own trace: it picks the CUDA kernels."""
    names = name_tuple(gpus, "gpus", flag="--gpu") or ()
    if "gpu" in setting_overrides or (settings is not None and settings.gpu is not None):
        raise SettingsError("which_gpu takes the cards as gpus; leave gpu out of the settings")
    if "budget" in setting_overrides:
        raise SettingsError("which_gpu compares each card's own memory; leave out budget")
    settings, plan = settings_from(settings, setting_overrides, inputs)
    if plan is not None:
        raise SettingsError("a plan file is made for one card's settings: estimate it with that one gpu")
    spec = model_source(model, inputs, loss, task)
    return run_gpu_choice(spec, settings, list(names), progress=checked_progress(progress))


@speaks_api_terms
@leaves_no_process_group
@spares_existing_objects
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
    settings, _ = settings_from(settings, setting_overrides, inputs)
    gpus = positive_count(gpus, "--gpus")
    spec = model_source(model, inputs, loss, task)
    return run_compare(
        spec, settings, gpus=gpus, budget_bytes=budget_in_bytes(budget, settings), progress=checked_progress(progress)
    )


@speaks_api_terms
@leaves_no_process_group
@spares_existing_objects
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
    spec, settings, budget_bytes = plan_inputs(
        model, settings, budget, inputs, loss, task, setting_overrides, candidates, jobs
    )
    if not isinstance(selective, bool):
        raise SettingsError(f"selective is True or False, got {selective!r}")
    return make_plan(
        spec,
        settings,
        budget_bytes,
        candidates=candidates,
        solver=solver,
        progress=checked_progress(progress),
        selective=selective,
        jobs=jobs,
    )


@speaks_api_terms
@leaves_no_process_group
@spares_existing_objects
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
    given = setting_overrides.get("batch_size", settings.batch_size if settings is not None else None)
    if given not in (None, TrainingSettings.batch_size):  # the CLI passes on the default
        raise UsageError("plan_batch chooses the batch size; leave out batch_size")
    spec, settings, budget_bytes = plan_inputs(
        model, settings, budget, inputs, loss, task, setting_overrides, candidates, jobs
    )
    return maximize_batch(
        spec,
        settings,
        budget_bytes,
        candidates=candidates,
        solver=solver,
        progress=checked_progress(progress),
        jobs=jobs,
    )


@speaks_api_terms
@leaves_no_process_group
@spares_existing_objects
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
    settings, loaded = settings_from(settings, setting_overrides, inputs)
    warmup, timeout_s = run_limits(warmup, timeout_s)
    if snapshot is not None and not isinstance(snapshot, str | os.PathLike):
        raise UsageError(f"snapshot must be a file path, got {snapshot!r}")
    check_can_measure(settings.device, snapshot)
    if is_model_object(model) or not (inputs is None or isinstance(inputs, str)):
        raise UsageError(
            "validate runs the step in a separate process, which cannot be handed Python objects: give the "
            "model as a name or 'package.module:factory' and its inputs as 'package.module:fn'"
        )
    spec = model_source(model, inputs, loss, task)
    settings = settings_for_plan(spec, settings, loaded)
    return validate_config(
        spec,
        settings,
        warmup=warmup,
        snapshot=snapshot,
        timeout_s=timeout_s,
        plan_fingerprint=loaded.fingerprint if loaded is not None else None,
        progress=checked_progress(progress),
    )


@speaks_api_terms
@leaves_no_process_group
@spares_existing_objects
def validate_suite(
    name: str,
    results: str | Path,
    *,
    device: str = "cuda",
    resume: bool = False,
    warmup: int = DEFAULT_WARMUP_ITERATIONS,
    timeout_s: float = DEFAULT_TIMEOUT_SECONDS,
    replace: bool = False,
) -> Iterator[tuple[SuiteConfig, ValidationResult | None]]:
    """Validate every configuration of a built-in suite, appending each result to `results` as it goes.

    Yields (configuration, result) as each finishes; the result is None for configurations a
    resumed run finds already in the file. An existing `results` file is refused unless `resume` continues it or
    `replace` starts it over.
    """
    if not isinstance(name, str):
        raise UsageError(f"name must be a suite name ({', '.join(SUITES)}), got {name!r}")
    configs = suite_named(name)
    if not isinstance(results, str | os.PathLike):
        raise UsageError(f"results must be a file path, got {results!r}")
    path = Path(results)
    if not path.resolve().parent.is_dir():  # before the first measurement, not after it
        raise UsageError(f"--results {path}: the folder {path.parent} does not exist; create it first")
    warmup, timeout_s = run_limits(warmup, timeout_s)
    if not isinstance(device, str):
        raise SettingsError(f"device must be a string, got {device!r} ({type(device).__name__})")

    for config in configs:  # before the first measurement: a CUDA-only setting had stopped the suite midway
        try:
            TrainingSettings(device=device, **config.settings)
        except SettingsError as error:
            raise UsageError(
                f"configuration {config.id} of suite {name} cannot run with --device {device}: {error}"
            ) from None

    def measure(config: SuiteConfig) -> ValidationResult:
        return validate(
            config.model, inputs=config.inputs, warmup=warmup, timeout_s=timeout_s, device=device, **config.settings
        )

    return run_suite(name, configs, path, measure, device=device, resume=resume, replace=replace)


# Importing memplan.validate.* above bound the subpackage to the name `memplan.validate`, which
# hid this module's `validate` from `import memplan; memplan.validate(...)`: the function wins.
sys.modules["memplan"].validate = validate  # type: ignore[attr-defined]
