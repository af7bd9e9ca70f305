"""Checkpointing plans as versioned JSON documents, and applying one to a real model."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from memplan.checkpoint_layout import CheckpointLayout
from memplan.errors import PlanFileError, SettingsError, UsageError, a_type
from memplan.estimator.checkpointing import apply_layout, key_value_cache_off
from memplan.gpus import DEFAULT_GPU
from memplan.models.fingerprint import check_fingerprint, model_fingerprint
from memplan.outputs import write_atomically
from memplan.planner.plan import PlanResult
from memplan.settings import CHECKPOINT_MODES, TrainingSettings
from memplan.sizes import MAX_SIZE_BYTES, format_bytes

PLAN_FORMAT = "memplan-checkpoint-plan"
PLAN_VERSION = 2  # 2 added each segment's checkpoint policy; version 1 files (all "full") still load
READABLE_VERSIONS = (1, 2)
# Settings a plan's prediction depends on; the checkpoint itself is what the plan provides.
# The settings a plan must share with the step it checkpoints: all but the layout itself and the bytes held outside
# torch's allocator (the CUDA context, NCCL's communicator), which change no traced request.
_OUTSIDE_THE_TRACE = ("checkpoint", "cuda_context", "nccl_memory")
_MATCHED_SETTINGS = tuple(field for field in TrainingSettings.__dataclass_fields__ if field not in _OUTSIDE_THE_TRACE)


@dataclass(frozen=True)
class Plan:
    model: str
    fingerprint: str
    settings: dict[str, Any]
    layout: CheckpointLayout
    budget_bytes: int
    fits: bool
    predicted_peak_bytes: int
    recompute_flops: int
    # --inputs, --loss and --task as the plan was made with them; None for a file written before they were kept
    source: dict[str, str | None] | None = None


# How a model is named besides its name: the batch, the loss and the head a plan's step was traced with.
SOURCE_FIELDS = ("inputs", "loss", "task")


def plan_document(result: PlanResult) -> dict[str, Any]:
    settings = result.settings.to_dict()
    settings.pop("checkpoint")
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "model": result.model,
        "source": {field: getattr(result, field) for field in SOURCE_FIELDS},
        "fingerprint": result.fingerprint,
        "settings": settings,
        "layout": result.layout.to_dict(),
        "budget_bytes": result.budget_bytes,
        "fits": result.fits,
        "predicted_peak_bytes": result.predicted_peak_bytes,
        "recompute_flops": result.recompute_flops,
    }


def write_plan(result: PlanResult, path: str | Path) -> None:
    text = (json.dumps(plan_document(result), indent=2) + "\n").encode()
    write_atomically(path, lambda file: file.write(text), "plan")


def load_plan(source: str | Path | Plan | PlanResult) -> Plan:
    """A plan from its file, or from what `memplan.plan` returned (the document its file would hold)."""
    if isinstance(source, Plan):
        return source
    if isinstance(source, PlanResult):
        return _plan_of(plan_document(source), "the plan")
    if not isinstance(source, str | os.PathLike):
        raise PlanFileError(
            "a plan is a file from `memplan plan --output` (its path), a loaded Plan or what memplan.plan returned; "
            f"got {a_type(source)}"
        )
    if not str(source).strip():  # Path("") is ".", a folder: "cannot read plan : Is a directory" said nothing
        raise PlanFileError(
            f"--checkpoint is empty: give one of {', '.join(CHECKPOINT_MODES)}, or a file from `memplan plan --output`"
        )
    try:
        document = json.loads(Path(source).read_text())
    except OSError as error:
        path = Path(source)
        if not path.exists() and not path.suffix and os.sep not in str(source):  # a policy's name mistyped
            meant = f"did you mean {str(source).lower()}? " if str(source).lower() in CHECKPOINT_MODES else ""
            raise PlanFileError(
                f"--checkpoint {source} is not one of {', '.join(CHECKPOINT_MODES)}, nor a plan file "
                f"({error.strerror}): {meant}give one of them, or a file from `memplan plan --output`"
            ) from None
        raise PlanFileError(f"cannot read plan {source}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise PlanFileError(
            f"{source} is not JSON ({error.msg}, line {error.lineno}); pass a file from `memplan plan --output`"
        ) from None
    except UnicodeDecodeError as error:  # a binary file, or a hand edit saved in another encoding
        raise PlanFileError(
            f"{source} is not a UTF-8 text file (byte {error.start}: {error.reason}); pass a file from "
            "`memplan plan --output`, saved as UTF-8"
        ) from None
    if not isinstance(document, dict) or document.get("format") != PLAN_FORMAT:
        raise PlanFileError(f"{source} is not a memplan checkpoint plan; make one with `memplan plan --output FILE`")
    return _plan_of(document, source)


def _plan_of(document: dict[str, Any], source: str | os.PathLike) -> Plan:
    """A plan document (plan_document's, or a file's) as a Plan; `source` names it in messages."""
    version = document.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:  # `true` equals 1, "2" is no version
        raise PlanFileError(
            f"{source} is plan format version {version!r}; this memplan reads version {PLAN_VERSION}: "
            "re-run `memplan plan`"
        )

    def field(name: str, kind: type | tuple[type, ...], what: str) -> Any:
        if name not in document:
            raise PlanFileError(f"{source} has no {name!r} field; re-run `memplan plan --output`")
        value = document[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise PlanFileError(f"{source}: {name!r} is {value!r}, not {what}; re-run `memplan plan --output`")
        return value

    try:
        layout = CheckpointLayout.from_dict(field("layout", dict, "an object of segments and policies"))
        plan_source = _source(document.get("source"))
    except SettingsError as error:
        raise PlanFileError(f"{source}: {error}; re-run `memplan plan --output`") from None
    except TypeError:
        raise PlanFileError(
            f"{source}: 'source' is not the model's inputs, loss and task; re-run `memplan plan --output`"
        ) from None
    budget_bytes = field("budget_bytes", int, "a whole number of bytes")
    if not 1 <= budget_bytes <= MAX_SIZE_BYTES:
        raise PlanFileError(f"{source}: 'budget_bytes' is {budget_bytes}, not a size; re-run `memplan plan --output`")
    return Plan(
        model=field("model", str, "a model name"),
        fingerprint=field("fingerprint", str, "a fingerprint"),
        settings=dict(field("settings", dict, "an object of settings")),
        layout=layout,
        budget_bytes=budget_bytes,
        fits=field("fits", bool, "true or false"),
        predicted_peak_bytes=field("predicted_peak_bytes", int, "a whole number of bytes"),
        recompute_flops=field("recompute_flops", int, "a whole number"),
        source=plan_source,
    )


def _source(value: Any) -> dict[str, str | None] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(value.get(field), str | None) for field in SOURCE_FIELDS):
        raise TypeError("'source'")
    return {field: value.get(field) for field in SOURCE_FIELDS}


def check_source(plan: Plan, source: dict[str, str | None]) -> None:
    """A plan traced with other --inputs, --loss or --task is a plan for another step (the fingerprint sees only
    the model's parameters): refused, as other settings are. Files written before the plan kept them pass."""
    if plan.source is None:
        return
    differing = [
        f"--{field} {plan.source[field] or '(none)'} in the plan, {source.get(field) or '(none)'} here"
        for field in SOURCE_FIELDS
        if plan.source[field] != source.get(field)
    ]
    if differing:
        raise PlanFileError(
            "the plan was made for another step of this model (" + "; ".join(differing) + "); give the plan's "
            "or make a new plan with `memplan plan`"
        )


def check_settings(plan: Plan, settings: TrainingSettings) -> None:
    wanted = _as_traced(settings.to_dict())
    defaults = TrainingSettings().to_dict()  # for settings added after the plan was written
    planned = _as_traced({field: plan.settings.get(field, defaults[field]) for field in _MATCHED_SETTINGS})
    # On another device the card follows from it (no --gpu on the cuda target is the default card): not news.
    other_device = planned.get("device") != wanted.get("device")
    differing = [
        f"{field} {planned[field]!r} in the plan, {wanted[field]!r} here"
        for field in _MATCHED_SETTINGS
        if planned[field] != wanted[field] and not (field == "gpu" and other_device)
    ]
    if differing:
        raise PlanFileError(
            "the plan was made for other settings (" + "; ".join(differing) + "); use the plan's settings "
            "or make a new plan with `memplan plan`"
        )


def _as_traced(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as the trace reads them: on the cuda target no --gpu is the default card."""
    if settings.get("device") == "cuda" and settings.get("gpu") is None:
        return {**settings, "gpu": DEFAULT_GPU}
    return settings


def _refuse_a_wrapper(model: nn.Module, plan: Plan) -> None:
    """A model wrapped after it was planned (DistributedDataParallel's `module`, torch.compile's `_orig_mod`) names
    its modules under the wrapper's prefix: the plan is for the model inside, which is what to say."""
    attribute = "_orig_mod" if isinstance(getattr(model, "_orig_mod", None), nn.Module) else "module"
    inner = getattr(model, attribute, None)
    if isinstance(inner, nn.Module) and model_fingerprint(inner) == plan.fingerprint:
        raise UsageError(
            f"this model wraps the model the plan was made for ({type(model).__name__}): apply the plan to the model "
            f"inside (`apply_plan(model.{attribute}, ...)`), or before wrapping it (DistributedDataParallel, "
            "torch.compile)"
        )


def apply_plan(model: nn.Module, plan: str | Path | Plan | PlanResult) -> list[str]:
    """Checkpoint a real model as a plan says (non-reentrant checkpoints); returns the modules checkpointed.

    The plan is refused if it was made for a model with other module names or parameter shapes, for a model
    that is checkpointed already (by an earlier apply_plan, or by Hugging Face's gradient_checkpointing_enable()),
    and where any module it names cannot be checkpointed; a refused plan leaves the model as it was. A Hugging
    Face model's `config.use_cache` is turned off, as transformers does under its own checkpointing.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"apply_plan checkpoints a real torch.nn.Module, built by your own code; got {a_type(model)}")
    if isinstance(plan, str) and plan in CHECKPOINT_MODES:
        raise UsageError(
            f"apply_plan takes a plan file written by `memplan plan --output`; {plan!r} is a --checkpoint mode of "
            "memplan's estimates, not a plan"
        )
    loaded = load_plan(plan)
    _refuse_a_wrapper(model, loaded)
    check_fingerprint(loaded.fingerprint, loaded.model, model, "this model")
    # Hugging Face's own checkpointing (gradient_checkpointing_enable() sets `gradient_checkpointing` on each
    # GradientCheckpointingLayer) would run inside the plan's checkpoints: every block recomputed twice over.
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        raise UsageError(
            "this model has Hugging Face gradient checkpointing on, and the plan checkpoints its own choice of "
            "modules: call model.gradient_checkpointing_disable() before apply_plan"
        )
    apply_layout(model, loaded.layout)
    if not loaded.fits:  # `memplan plan` writes its best try when nothing fits; applied, it may still run out
        warnings.warn(
            f"this plan does not fit its budget ({format_bytes(loaded.predicted_peak_bytes)} predicted, budget "
            f"{format_bytes(loaded.budget_bytes)}): the step may run out of memory; `memplan plan` printed what "
            "would fit (a smaller batch, accumulation)",
            stacklevel=2,
        )
    # A checkpointed block that recomputes would write the key/value cache again: transformers turns the cache
    # off under its own checkpointing in training ("`use_cache=True` is incompatible with gradient
    # checkpointing"); under a selective plan the second write fails torch's check that the recomputation repeats
    # the forward. So the cache goes off here too (the plan is made for training; set it back to generate).
    key_value_cache_off(model)
    return list(loaded.layout.modules)
