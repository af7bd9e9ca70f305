"""Read a Hugging Face `TrainingArguments` file (JSON or YAML) into memplan's training settings.

The keys read are the ones that change one GPU's memory; the rest of TrainingArguments (learning
rate, logging, saving, ...) is ignored. Mappings follow transformers' Trainer (transformers 5.x,
trainer.py `get_optimizer_cls_and_kwargs` and training_args.py):

- per_device_train_batch_size -> batch_size; gradient_accumulation_steps -> grad_accum
- activation_checkpointing (or its deprecated alias gradient_checkpointing, read where the new name is
  not set, as training_args.py `__post_init__` resolves them): true -> checkpoint "all" (Trainer calls
  activation_checkpointing_enable, which checkpoints every decoder/encoder layer, as memplan's "all" does,
  non-reentrant by default in transformers 5: modeling_utils `_activation_checkpointing_enable`); of
  activation_checkpointing_kwargs (or gradient_checkpointing_kwargs), use_reentrant: true and offload: true
  are noted, not modelled, and every_n_layers other than 1 is refused (it checkpoints only some layers)
- label_smoothing_factor > 0 -> label_smoothing: the Trainer's LabelSmoother computes the loss in the
  hf-trainer loop (memplan.estimator.trainer_loss); refused under DeepSpeed
- bf16 / fp16: true -> amp-bf16 / amp-fp16 (Trainer autocasts through accelerate; the weights stay fp32); fp16 on
  the cpu target -> fp32 (accelerate runs no fp16 autocast on the CPU)
- optim -> OPTIMS below; the default is adamw_torch_fused, as TrainingArguments' on torch >= 2.8
- full_determinism: true -> deterministic algorithms, cudnn.benchmark off and CUBLAS_WORKSPACE_CONFIG
  ":16:8" (trainer_utils.enable_full_determinism sets exactly these)
- tf32: true / false -> torch.backends.cudnn.allow_tf32 (training_args.py enable_tf32 sets it with
  the matmul flag); left out, the torch default (true for cuDNN) stands

Noted, not modelled (each changes the memory): torch_compile (or a torch_compile_backend / _mode, which
turn it on), neftune_noise_alpha (a transient embedding-sized noise tensor in each forward), use_liger_kernel
(Liger's kernels and fused loss), use_cache: true (a key/value cache in each training forward, freed before
the backward), torch_empty_cache_steps on the cuda target (the reserved figure). Measured against the Trainer
on the CPU and found not to move one rank's peak: average_tokens_across_devices (a scalar count),
torch_empty_cache_steps on the cpu target. optim_target_modules only serves the GaLore / APOLLO optims, which
the optim mapping refuses.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.api_terms import speaks_api_terms
from memplan.distributed.deepspeed_file import parse_deepspeed_config, with_zero_section_read
from memplan.distributed.modes import DEEPSPEED_MODE_OF_STAGE
from memplan.errors import HfArgsError, SettingsError, a_type

# TrainingArguments.optim -> (memplan optimizer, optimizer implementation).
OPTIMS: dict[str, tuple[str, str]] = {
    "adamw_torch": ("adamw", "default"),
    "adamw_torch_fused": ("adamw", "fused"),
    "adamw_hf": ("adamw", "default"),
    "adafactor": ("adafactor", "default"),
    "adamw_bnb_8bit": ("adam8bit", "default"),
    "adamw_8bit": ("adam8bit", "default"),  # an alias of adamw_bnb_8bit in OptimizerNames
    "paged_adamw_8bit": ("paged-adam8bit", "default"),
    "sgd": ("sgd", "default"),
}
DEFAULT_OPTIM = "adamw_torch_fused"  # TrainingArguments.optim's default with torch >= 2.8
# Keys that put the run outside one GPU holding everything, which memplan does not model.
_SHARDING_KEYS = ("fsdp", "deepspeed")
# Fields of transformers releases newer than the oldest memplan supports (5.17 has neither): read whether or not the
# installed TrainingArguments has them (a file saved by a newer release is for a run on one), with a note where not.
NEWER_READ_KEYS = frozenset({"activation_checkpointing", "activation_checkpointing_kwargs"})
# Every TrainingArguments field this module reads.
READ_KEYS = frozenset(
    {
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "activation_checkpointing",
        "activation_checkpointing_kwargs",
        "label_smoothing_factor",
        "neftune_noise_alpha",
        "use_liger_kernel",
        "torch_empty_cache_steps",
        "use_cache",
        "torch_compile_backend",
        "torch_compile_mode",
        "bf16",
        "fp16",
        "optim",
        "optim_args",
        "max_grad_norm",
        "torch_compile",
        "full_determinism",
        "tf32",
        *_SHARDING_KEYS,
    }
)


@dataclass(frozen=True)
class HfTrainingArgs:
    """The settings a TrainingArguments file gives, and what memplan noticed but does not model."""

    path: str
    settings: dict[str, Any]
    notes: tuple[str, ...]


def _load(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise HfArgsError(f"cannot read --hf-args {path}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise HfArgsError(f"--hf-args {path} is not UTF-8 text; save it as UTF-8 JSON or YAML") from error
    import yaml

    kind = "YAML" if path.suffix.lower() in (".yaml", ".yml") else "JSON"
    try:
        data = yaml.safe_load(text) if kind == "YAML" else json.loads(text)
    except (ValueError, yaml.YAMLError) as error:
        raise HfArgsError(f"--hf-args {path} is not valid {kind}: {error}".splitlines()[0]) from error
    if not isinstance(data, dict):
        raise HfArgsError(f"--hf-args {path} must hold one mapping of TrainingArguments fields")
    return data


def _flag(data: dict[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _positive_int(data: dict[str, Any], key: str, path: Path) -> int | None:
    if key not in data or data[key] is None:
        return None
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HfArgsError(f"--hf-args {path}: {key} must be a positive integer, got {value!r}")
    return value


def _momentum(optim_args: object) -> float:
    """SGD's momentum from TrainingArguments.optim_args ("momentum=0.9,nesterov=True")."""
    if not isinstance(optim_args, str):
        return 0.0
    match = re.search(r"(?:^|,)\s*momentum\s*=\s*([0-9.eE+-]+)", optim_args)
    return float(match.group(1)) if match else 0.0


@functools.cache
def training_argument_fields() -> tuple[str, ...]:
    """The installed transformers' TrainingArguments fields."""
    from transformers import TrainingArguments

    return tuple(field.name for field in dataclasses.fields(TrainingArguments))


def _unknown_keys(data: dict[str, Any], path: Path) -> list[str]:
    """Keys TrainingArguments does not have, each with the field it is closest to, if any.

    A near miss of a field memplan reads is an error: the setting it meant changes memory and would
    be silently lost. Other unknown keys (typos of fields that do not matter here, or fields of
    other transformers releases, like 4.x's evaluation_strategy) are listed in a note.
    """
    fields = training_argument_fields()
    described = []
    for key in sorted(key for key in data if key not in fields and key not in NEWER_READ_KEYS):
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.8)
        if close and close[0] in READ_KEYS:
            raise HfArgsError(f"--hf-args {path}: {key!r} is not a TrainingArguments field; did you mean {close[0]!r}?")
        described.append(f"{key} (did you mean {close[0]}?)" if close else key)
    return described


def _aliased(data: dict[str, Any], key: str) -> str:
    """The key TrainingArguments takes `key`'s value from: activation_checkpointing(_kwargs) where the file sets
    it, else its deprecated alias gradient_checkpointing(_kwargs) (training_args.py __post_init__)."""
    # A file saved by a newer transformers than the installed one (5.17 has only the old name) names the setting of
    # the run it is for: read as that release reads it.
    return key if data.get(key) is not None else key.replace("activation_", "gradient_", 1)


def _read_checkpointing(
    data: dict[str, Any], path: Path, settings: dict[str, Any], notes: list[str], device: str
) -> None:
    """activation_checkpointing and its kwargs, as Trainer._setup_model... hands them to the model's
    activation_checkpointing_enable (trainer.py): every_n_layers and offload are popped, the rest goes to
    torch.utils.checkpoint."""
    newer = sorted(key for key in NEWER_READ_KEYS if key in data and key not in training_argument_fields())
    if newer:
        notes.append(
            f"{', '.join(newer)}: read as transformers 5.25 and later read them (this transformers' TrainingArguments "
            "names them gradient_checkpointing and gradient_checkpointing_kwargs)"
        )
    if not _flag(data, key := _aliased(data, "activation_checkpointing")):
        return
    settings["checkpoint"] = "all"
    kwargs_key = _aliased(data, "activation_checkpointing_kwargs")
    checkpointing = data.get(kwargs_key) or {}
    if isinstance(checkpointing, str) and checkpointing.startswith("{"):  # TrainingArguments parses such strings
        try:
            checkpointing = json.loads(checkpointing)
        except ValueError as error:
            raise HfArgsError(f"--hf-args {path}: {kwargs_key} is not valid JSON: {error}") from error
    if not isinstance(checkpointing, dict):
        raise HfArgsError(f"--hf-args {path}: {kwargs_key} must be a mapping, got {checkpointing!r}")
    every = checkpointing.get("every_n_layers", 1)
    if every != 1:
        # modeling_utils._set_gradient_checkpointing: only layers whose index is a multiple of it are checkpointed.
        raise HfArgsError(
            f"--hf-args {path}: {kwargs_key} every_n_layers {every!r} checkpoints only some layers, which memplan "
            f"does not read from the file: remove {key} from it and give --checkpoint a plan file whose layout names "
            "those layers"
        )
    if checkpointing.get("offload") and device == "cuda":
        notes.append(
            f"{kwargs_key} offload: true keeps the checkpointed layers' inputs in pinned host memory (save_on_cpu); "
            "memplan keeps them on the device, so its figure is high by them"
        )
    if checkpointing.get("use_reentrant") is True:
        notes.append(
            f"{kwargs_key} use_reentrant: true is traced as a non-reentrant checkpoint "
            "(transformers' default): a reentrant one recomputes each layer whole in the backward, with no "
            "early stop, and can hold a little more there"
        )


def _deepspeed_path(value: object, path: Path) -> Path | None:
    """The ds_config.json a TrainingArguments.deepspeed string names, as the Trainer resolves it (from the
    working directory; memplan also tries the arguments file's folder); None where neither is a file."""
    candidates = [Path(str(value)), path.parent / str(value)]
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def deepspeed_file_of(path: str | Path) -> Path | None:
    """The DeepSpeed configuration file an --hf-args file names in its deepspeed entry, or None (no entry, the
    configuration written inline, or a file that cannot be read: read_training_args says why)."""
    try:
        value = _load(Path(path)).get("deepspeed")
    except HfArgsError:
        return None
    return _deepspeed_path(value, Path(path)) if isinstance(value, str) and value else None


def _deepspeed_config(value: object, path: Path) -> dict[str, Any]:
    """TrainingArguments.deepspeed: a ds_config.json path (_deepspeed_path) or the configuration itself."""
    if isinstance(value, dict):
        try:
            return with_zero_section_read(value)
        except SettingsError as error:
            raise HfArgsError(f"--hf-args {path}: its deepspeed entry: {error}") from error
    found = _deepspeed_path(value, path)
    if found is None:
        raise HfArgsError(f"--hf-args {path} sets deepspeed {value!r}, which is not a file here or beside {path.name}")
    try:
        return parse_deepspeed_config(found.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SettingsError) as error:
        raise HfArgsError(f"--hf-args {path}: its deepspeed file {found}: {error}") from error


def _with_deepspeed(
    config: dict[str, Any],
    path: Path,
    settings: dict[str, Any],
    notes: list[str],
    world_size_given: bool,
) -> None:
    """A Trainer run under DeepSpeed: one ZeRO-2 or ZeRO-3 rank traced with DeepSpeed itself (the
    Trainer hands bf16 to DeepSpeed's own, not to autocast); the other stages are refused in one line."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in DEEPSPEED_MODE_OF_STAGE:
        raise HfArgsError(
            f"--hf-args {path} runs DeepSpeed's ZeRO stage {stage}; memplan traces stages 1, 2 and 3 (--parallel "
            "zero1 with the file, zero2, zero3); without ZeRO give --parallel ddp with --world-size N"
        )
    settings["parallel"] = DEEPSPEED_MODE_OF_STAGE[stage]
    settings["deepspeed_config"] = json.dumps(config, sort_keys=True)
    # The file cannot say how many ranks the job runs (the launcher does): asked for where it was not given.
    ask = "" if world_size_given else "; give --world-size N for the job's data-parallel ranks"
    notes.append(f"deepspeed: one ZeRO-{stage} rank traced with DeepSpeed itself{ask}")


@speaks_api_terms
def read_training_args(
    path: str | Path,
    *,
    read_optim: bool = True,
    world_size_given: bool = False,
    deepspeed_given: bool = False,
    device: str = "cuda",
) -> HfTrainingArgs:
    """Settings from a TrainingArguments JSON/YAML file (as saved by `TrainingArguments.to_json_string`).

    `read_optim=False` leaves the optimizer out (the caller names one itself), so an optim memplan
    cannot model is no error then. `world_size_given`: the caller gives the job's ranks itself, so a
    DeepSpeed file's note does not ask for them. `deepspeed_given`: the caller gives the DeepSpeed configuration
    itself (--deepspeed), which replaces the file's deepspeed entry: the file's stage and its note are left out,
    and the run is still DeepSpeed's (its loop, its bf16). `device`: the target the settings are for ("cpu": fp16
    is no mixed precision there).
    """
    if not isinstance(path, str | os.PathLike):
        raise HfArgsError(f"a TrainingArguments file is a path (str or pathlib.Path); got {a_type(path)}")
    path = Path(path)
    data = _load(path)
    settings: dict[str, Any] = {}
    notes: list[str] = []
    unknown = _unknown_keys(data, path)
    if unknown:
        notes.append(f"not TrainingArguments fields in this transformers, so ignored: {', '.join(unknown)}")
    if data.get("fsdp"):
        raise HfArgsError(
            f"--hf-args {path} sets fsdp, which the Trainer hands to accelerate's FSDP plugin, whose settings memplan "
            "does not read yet: remove fsdp from the file and give --parallel fsdp (or fsdp-grad-op) --world-size N, "
            "which traces one FSDP2 rank"
        )
    # A --deepspeed the caller gives replaces the file's entry (its stage and sections); the run is DeepSpeed's
    # either way.
    entry = data.get("deepspeed") if not deepspeed_given else None
    deepspeed = _deepspeed_config(entry, path) if entry else None
    runs_deepspeed = deepspeed is not None or deepspeed_given
    batch_size = _positive_int(data, "per_device_train_batch_size", path)
    if batch_size is not None:
        settings["batch_size"] = batch_size
    grad_accum = _positive_int(data, "gradient_accumulation_steps", path)
    if grad_accum is not None:
        settings["grad_accum"] = grad_accum
    _read_checkpointing(data, path, settings, notes, device)
    if _flag(data, "bf16") and _flag(data, "fp16"):
        raise HfArgsError(f"--hf-args {path} sets both bf16 and fp16; TrainingArguments refuses that too")
    # Under DeepSpeed the Trainer hands bf16 and fp16 to DeepSpeed's own (16-bit weights, float32 master weights);
    # alone it runs them as autocast.
    if _flag(data, "bf16"):
        settings["precision"] = "bf16" if runs_deepspeed else "amp-bf16"
    elif _flag(data, "fp16") and device == "cpu" and not runs_deepspeed:
        # accelerate turns fp16 off on the CPU without a word (accelerator.py: GradScaler and native amp only where
        # `self.device.type != "cpu"`): the Trainer's CPU step runs in float32.
        notes.append("fp16 on the cpu target: accelerate runs the Trainer's CPU step in float32, so memplan does too")
    elif _flag(data, "fp16"):
        settings["precision"] = "fp16" if runs_deepspeed else "amp-fp16"
    if deepspeed is not None:
        _with_deepspeed(deepspeed, path, settings, notes, world_size_given)
    optim = str(data.get("optim") or DEFAULT_OPTIM).lower() if read_optim else None
    if optim is not None and optim not in OPTIMS:
        raise HfArgsError(
            f"--hf-args {path}: memplan cannot model optim {optim!r}; it models {', '.join(OPTIMS)} "
            "(or pass --optimizer to override the file)"
        )
    if optim is not None:
        settings["optimizer"], settings["optimizer_impl"] = OPTIMS[optim]
    if optim == "sgd" and _momentum(data.get("optim_args")) > 0:
        settings["optimizer"] = "sgd-momentum"
    if optim == "adafactor":
        notes.append(
            "optim adafactor is transformers' Adafactor; memplan traces torch.optim.Adafactor, whose factored "
            "state has the same shapes"
        )
    if _flag(data, "full_determinism"):
        settings.update(deterministic=True, cudnn_benchmark=False, cublas_workspace_config=":16:8")
    if data.get("tf32") is not None:
        settings["cudnn_allow_tf32"] = _flag(data, "tf32")
    # Trainer's own loop: clipping to max_grad_norm before the step, model.zero_grad() after it;
    # with DeepSpeed, the engine's (its backward and step, clipping inside it).
    settings["loop"] = "canonical" if runs_deepspeed else "hf-trainer"
    max_grad_norm = data.get("max_grad_norm", 1.0)
    if not max_grad_norm:
        notes.append("max_grad_norm 0 turns Trainer's clipping off; memplan traces it anyway (a few scalars in excess)")
    _read_trainer_loss(data, path, settings, runs_deepspeed)
    # A backend or mode alone turns torch_compile on (training_args.py __post_init__).
    backend_or_mode = (key for key in ("torch_compile_backend", "torch_compile_mode") if data.get(key) is not None)
    compiled = "torch_compile" if _flag(data, "torch_compile") else next(backend_or_mode, None)
    if compiled is not None:
        notes.append(f"{compiled} is not modelled: memplan predicts the eager step, compiled steps usually use less")
    notes.extend(_unmodelled_notes(data, device))
    return HfTrainingArgs(str(path), settings, tuple(notes))


def _read_trainer_loss(data: dict[str, Any], path: Path, settings: dict[str, Any], runs_deepspeed: bool) -> None:
    """label_smoothing_factor: the Trainer's own loss (memplan.estimator.trainer_loss), in the hf-trainer loop."""
    factor = data.get("label_smoothing_factor") or 0.0
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 0:
        raise HfArgsError(f"--hf-args {path}: label_smoothing_factor must be a number, 0 or more, got {factor!r}")
    if factor and runs_deepspeed:
        raise HfArgsError(
            f"--hf-args {path} sets label_smoothing_factor under DeepSpeed, whose engine memplan does not trace with "
            "the Trainer's label smoother: remove label_smoothing_factor (memplan's figure is then low by about two "
            "float32 logits-sized tensors)"
        )
    if factor:
        settings["label_smoothing"] = float(factor)


def _unmodelled_notes(data: dict[str, Any], device: str) -> list[str]:
    """What the file turns on that changes the memory and memplan does not model, one note each."""
    notes = []
    if data.get("neftune_noise_alpha") is not None:
        notes.append(
            "neftune_noise_alpha: the Trainer's NEFTune hook (integrations/neftune.py) adds uniform noise to the "
            "input embeddings in each forward, a transient tensor of their size that memplan leaves out"
        )
    if _flag(data, "use_liger_kernel"):
        notes.append(
            "use_liger_kernel is not modelled: memplan traces the model's own layers and loss; Liger's kernels "
            "(its fused linear cross entropy never makes the logits) usually use less"
        )
    if data.get("torch_empty_cache_steps") and device == "cuda":
        notes.append(
            "torch_empty_cache_steps: the Trainer empties the CUDA cache between a step's forward and backward every "
            "so many steps; memplan's reserved figure assumes a cache kept (the allocated peak is the same)"
        )
    if _flag(data, "use_cache"):
        notes.append(
            "use_cache: true lets the model fill a key/value cache in each training forward, which memplan's trace "
            "leaves off (the Trainer frees it with the outputs, before the backward)"
        )
    return notes
