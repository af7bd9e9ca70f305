"""The Python API's arguments made memplan's inputs, with the messages the CLI gives: a wrong type is one
MemplanError line at the boundary, not a TypeError from deep inside the trace (memplan.api)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from memplan.checkpoint_layout import CheckpointLayout
from memplan.errors import MemplanError, SettingsError, UsageError, a_type
from memplan.gpus import gpu_named
from memplan.models.objects import batch_size_of, is_model_object, object_spec
from memplan.models.source import ModelSpec, resolve_model
from memplan.planner.plan import PlanResult
from memplan.planner.plan_file import Plan, check_settings, check_source, load_plan
from memplan.settings import CHECKPOINT_MODES, TrainingSettings
from memplan.sizes import parse_size

_MODEL_FORMS = (
    "a preset name (`memplan presets`), a transformers model type, a config.json or model directory, "
    "a cached hub id, 'package.module:callable' returning an nn.Module, an nn.Module, or a callable returning one"
)


def _model_name(model: Any) -> str:
    """The model argument as the string the CLI takes (a path object is its path)."""
    if isinstance(model, os.PathLike):
        return os.fspath(model)
    if isinstance(model, str):
        return model
    raise UsageError(f"model must be {_MODEL_FORMS}; got a value of type {type(model).__name__}")


def _import_path(value: Any, option: str, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise UsageError(
        f"{option} must be 'package.module:fn' (the CLI's --{option}), where {what}; "
        f"got a value of type {type(value).__name__}"
    )


def model_source(model: Any, inputs: Any, loss: Any, task: Any) -> ModelSpec:
    if is_model_object(model):
        if task is not None:
            raise UsageError("task picks the head memplan builds for a transformers model; a model object has its own")
        return object_spec(model, inputs, loss)
    name = _model_name(model)
    inputs = _import_path(inputs, "inputs", "fn(batch_size) returns the batch")
    loss = _import_path(loss, "loss", "fn(output, batch) returns the scalar loss")
    return resolve_model(name, inputs=inputs, loss=loss, task=task)  # which checks the task


# How TrainingSettings' own messages name the integer fields.
_SETTING_NAMES = {
    "batch_size": "batch size",
    "grad_accum": "gradient accumulation steps",
    "seq_len": "sequence length",
    "target_len": "target length",
    "image_size": "image size",
    "cuda_context": "CUDA context (bytes)",
    "nccl_memory": "NCCL memory (bytes)",
    "cudnn_workspace_cap_mib": "cuDNN workspace cap (MiB)",
    "lora_rank": "LoRA rank",
}


def _check_types(values: dict[str, Any]) -> dict[str, Any]:
    """Each TrainingSettings field given the type its annotation names (bool is no integer here)."""
    checked = dict(values)
    for name, value in values.items():
        kind = str(TrainingSettings.__dataclass_fields__[name].type)
        optional = kind.endswith("| None")
        if value is None and optional:
            continue
        if name in ("cuda_context", "nccl_memory") and isinstance(value, str):
            # "600MiB" (or "0"), as the CLI's --cuda-context and --nccl-memory take it
            checked[name] = parse_size(value, allow_zero=True)
            continue
        base = kind.removesuffix("| None").strip()
        if base == "int":
            if value is None or isinstance(value, bool) or not isinstance(value, int):
                what = (
                    "an integer"
                    if name in ("cuda_context", "nccl_memory", "cudnn_workspace_cap_mib")
                    else "a positive integer"
                )
                raise SettingsError(f"{_SETTING_NAMES.get(name, name)} must be {what}, got {value!r}")
        elif base == "bool":
            if not isinstance(value, bool):
                raise SettingsError(f"{name} is True or False, got {value!r}")
        elif base == "float":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SettingsError(f"{name} must be a number, got {value!r}")
            checked[name] = float(value)
        elif base == "str":
            if not isinstance(value, str):
                what = "a function or its 'package.module:function'" if name == "step" else "a string"
                raise SettingsError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    return checked


def settings_from(
    settings: TrainingSettings | None, overrides: dict[str, Any], inputs: Any = None
) -> tuple[TrainingSettings, Plan | None]:
    """Settings from a base and keyword overrides; `checkpoint` may also be a plan (file or loaded).
    A batch given as `inputs` sets the batch size where neither settings nor overrides do."""
    if settings is None and "batch_size" not in overrides and not isinstance(inputs, str):
        rows = batch_size_of(inputs)
        if rows is not None:
            overrides = {**overrides, "batch_size": rows}
    if settings is not None and not isinstance(settings, TrainingSettings):
        hint = " (pass a dict as keyword arguments: **settings)" if isinstance(settings, dict) else ""
        raise SettingsError(f"settings must be a memplan.TrainingSettings or None, got {a_type(settings)}{hint}")
    TrainingSettings.refuse_unknown(overrides)  # before any file the others name is read
    if callable(overrides.get("step")):
        overrides = {**overrides, "step": _step_path(overrides["step"])}
    targets = overrides.get("lora_targets")
    if isinstance(targets, list | tuple) and all(isinstance(name, str) for name in targets):
        # peft's target_modules as a list, which settings (and the CLI's --lora-targets) keep comma-separated
        overrides = {**overrides, "lora_targets": ",".join(targets)}
    deepspeed = overrides.get("deepspeed_config")
    if isinstance(deepspeed, os.PathLike) or (isinstance(deepspeed, str) and deepspeed.strip()[:1] not in "{["):
        # a file's path, as the CLI's --deepspeed takes it (JSON text starts with a brace)
        overrides = {**overrides, "deepspeed_config": _deepspeed_file(deepspeed)}
    if isinstance(overrides.get("deepspeed_config"), dict):  # a DeepSpeed configuration, as deepspeed takes it
        overrides = {**overrides, "deepspeed_config": json.dumps(overrides["deepspeed_config"], sort_keys=True)}
    overrides = _check_types(overrides)
    checkpoint = overrides.get("checkpoint")
    plan = None
    if isinstance(checkpoint, Plan | PlanResult | os.PathLike) or (
        isinstance(checkpoint, str) and checkpoint not in CHECKPOINT_MODES
    ):
        plan = load_plan(checkpoint)
        overrides = {**overrides, "checkpoint": plan.layout}
    elif checkpoint is not None and not isinstance(checkpoint, str | CheckpointLayout):
        raise SettingsError(
            f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, a CheckpointLayout, a plan file or what "
            "memplan.plan returned; "
            f"got {checkpoint!r}"
        )
    return (settings or TrainingSettings()).replace(**overrides), plan


def _deepspeed_file(path: str | os.PathLike) -> str:
    """A DeepSpeed configuration file's JSON text, as the CLI's --deepspeed reads it."""
    from memplan.distributed.deepspeed_file import parse_deepspeed_config

    try:
        with open(path, encoding="utf-8") as handle:
            return json.dumps(parse_deepspeed_config(handle.read()), sort_keys=True)
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise SettingsError(
            f"deepspeed_config {os.fspath(path)!r} is neither a DeepSpeed configuration (a dict or its JSON text) "
            f"nor a file memplan can read ({reason})"
        ) from None
    except SettingsError as error:
        raise SettingsError(f"deepspeed_config {os.fspath(path)}: {error}") from None


def _step_path(function: Any) -> str:
    """A step given as a function: its `module:name`, which settings (and plan files) keep, when
    importing that name gives the same function back."""
    from memplan.models.imports import import_object

    path = f"{getattr(function, '__module__', '')}:{getattr(function, '__qualname__', '')}"
    try:
        # __main__ imports here, but not in validate's measuring process, nor in a later run that reads a plan
        same = not path.startswith("__main__:") and import_object(path, "step") is function
    except MemplanError:
        same = False
    if not same:
        raise SettingsError(
            f"step {function!r} cannot be imported by name; define it at the top level of an importable "
            "module (not a lambda, a nested function or __main__) and pass it, or its package.module:function"
        )
    return path


def budget_in_bytes(budget: str | int | None, settings: TrainingSettings) -> int | None:
    """An explicit budget, else the usable memory of the named GPU, else none."""
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, str | int | float):
            raise SettingsError(f"budget must be a size such as '24GiB', '80GB' or a number of bytes; got {budget!r}")
        if isinstance(budget, float):
            # A float is a number of bytes, as Python writes large ones (24e9): whole, or refused rather than
            # truncated (1.5 would be 1 byte) or misread (str(1e16) is '1e+16').
            if not budget.is_integer():
                raise SettingsError(f"budget must be a whole number of bytes or a size such as '24GiB'; got {budget!r}")
            budget = int(budget)
        return parse_size(budget)
    if settings.gpu is None:
        return None
    fraction = settings.allocator_config.per_process_memory_fraction
    return gpu_named(settings.gpu).budget_bytes(settings.outside_allocator_bytes, fraction)


def checked_progress(progress: Any) -> Any:
    if progress is not None and not callable(progress):
        raise UsageError(f"progress must be a function taking one message string, or None; got {progress!r}")
    return progress


def positive_count(value: Any, name: str, allow_none: bool = False) -> int | None:
    """A positive integer argument (not a bool, a float or a string)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SettingsError(f"{name} must be a positive integer, got {value!r}")
    return value


def name_tuple(values: Any, option: str, flag: str | None = None) -> tuple[str, ...] | None:
    """A tuple of names; a string is a comma-separated list, as the CLI's option takes it (`flag`, where it is not
    `option` spelled as a flag)."""
    if values is None:
        return None
    if isinstance(values, str):
        names = [part.strip() for part in values.split(",")] if values.strip() else []
        if not all(names):  # an empty entry ("fp32,,bf16") is a typo, as the CLI's option takes it
            from memplan.api_terms import speaks_command_line

            named = flag if flag is not None and speaks_command_line() else option
            raise SettingsError(f"{named} has an empty name between its commas; got {values!r}")
        values = names
    if not isinstance(values, Iterable) or not all(isinstance(value, str) for value in values):
        raise SettingsError(
            f"{option} must be names as strings (a list, or one comma-separated string); got {values!r}"
        )
    return tuple(values) or None


def batch_size_tuple(values: Any) -> tuple[int, ...]:
    if isinstance(values, str):
        try:
            # int() refuses an empty entry ("1,,2"), as the CLI's --batch-sizes does
            values = [int(part) for part in values.split(",")] if values.strip() else []
        except ValueError:
            raise SettingsError(f"batch_sizes takes integers, e.g. (1, 2, 4, 8) or '1,2,4,8'; got {values!r}") from None
    if not isinstance(values, Iterable) or not all(
        isinstance(value, int) and not isinstance(value, bool) for value in values
    ):
        raise SettingsError(f"batch_sizes takes positive integers, e.g. (1, 2, 4, 8); got {values!r}")
    return tuple(values)


def settings_for_plan(spec: ModelSpec, settings: TrainingSettings, plan: Plan | None) -> TrainingSettings:
    settings = spec.settings_for(settings)
    if plan is not None:
        check_source(plan, spec.ref.to_dict())
        check_settings(plan, settings)
    return settings


def plan_inputs(
    model: str,
    settings: TrainingSettings | None,
    budget: str | int | None,
    inputs: str | None,
    loss: str | None,
    task: str | None,
    overrides: dict[str, Any],
    candidates: str | None = None,
    jobs: int | None = None,
) -> tuple[ModelSpec, TrainingSettings, int]:
    """plan's and plan_batch's arguments: the model, its settings (checkpointing left to the plan) and the
    budget, which a plan cannot do without."""
    if overrides.get("checkpoint", "none") != "none":
        raise SettingsError("a plan chooses the checkpointing itself: drop checkpoint=")
    settings, _ = settings_from(settings, {**overrides, "checkpoint": "none"}, inputs)
    if candidates is not None and not isinstance(candidates, str):
        raise SettingsError(f"candidates must be a regular expression (a string) over module names; got {candidates!r}")
    positive_count(jobs, "jobs", allow_none=True)
    budget_bytes = budget_in_bytes(budget, settings)
    if budget_bytes is None:
        raise SettingsError("a plan needs a budget: pass --budget (e.g. 24GiB) or --gpu NAME")
    return model_source(model, inputs, loss, task), settings, budget_bytes


def run_limits(warmup: Any, timeout_s: Any) -> tuple[int, float]:
    """A real run's warm-up count and time limit, checked as the CLI's --warmup and --timeout are."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise SettingsError(
            f"--warmup must be an integer of at least 1 (the first iteration creates the optimizer state), "
            f"got {warmup!r}"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise SettingsError(f"--timeout must be a positive number of seconds, got {timeout_s!r}")
    return warmup, float(timeout_s)
