"""What a DeepSpeed configuration (`--deepspeed ds_config.json`, or `--hf-args`' deepspeed entry) says about the
settings memplan takes from its own options: precision, batch, accumulation and optimizer.

memplan builds the rank's engine with its own values for these (memplan.distributed.deepspeed_config, MEMPLAN_SETS), as
transformers' Trainer fills the file's "auto" values from TrainingArguments. Where the file gives one of them
outright, the Trainer checks it against its arguments and stops on a mismatch (integrations/deepspeed.py,
`HfTrainerDeepSpeedConfig.fill_match`: "Please correct the following DeepSpeed config values that mismatch
TrainingArguments values"). memplan does the same for the precision, which decides the model's dtype and so most of
the memory: a file that enables a precision other than --precision is an error. A batch, accumulation or optimizer
that differs from memplan's options is replaced and said so in a note, since `--budget` and `sweep` vary the batch
on purpose. DeepSpeed's torch_autocast section is --precision amp-bf16 or amp-fp16 (by its dtype). Pure: no torch.
"""

from __future__ import annotations

import json
from typing import Any

from memplan.errors import SettingsError

# DeepSpeed's precision sections (runtime/config.py: "bf16", with "bfloat16" its older name; "fp16") and the
# --precision each one is.
PRECISION_SECTIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16"}
# DeepSpeed's torch.autocast around the model (runtime/torch_autocast.py, autocast_if_enabled), float32 master weights.
AUTOCAST_SECTION = "torch_autocast"
# The dtype memplan gives torch_autocast for each autocast --precision, and the names DeepSpeed takes for each
# 16-bit dtype there (runtime/config.py, DtypeEnum).
AUTOCAST_DTYPE_NAMES = {"amp-bf16": "bfloat16", "amp-fp16": "float16"}
AUTOCAST_PRECISION_OF_DTYPE = {
    **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16"), "amp-bf16"),
    **dict.fromkeys(("torch.float16", "fp16", "float16", "half"), "amp-fp16"),
}
# DeepSpeed's optimizer types whose state is two float32 moments per parameter, as torch's Adam and AdamW
# (runtime/config.py: ADAM_OPTIMIZER "adam", ADAMW_OPTIMIZER "adamw"; FusedAdam, DeepSpeedCPUAdam), and so
# memplan's --optimizer names for the same two.
ADAM_KINDS = ("adam", "adamw")


def _as_deepspeed_reads_it(key: str, value: Any) -> bool:
    """A precision section's "enabled" as DeepSpeed 0.19 reads it (runtime/precision_config.py): bf16 and fp16 are
    pydantic models (DeepSpeedConfigModel, `enabled: bool`), so pydantic's own bool validation, which DeepSpeed
    installs with itself; what it refuses is a one-line error."""
    if isinstance(value, bool):
        return value
    try:
        from pydantic import TypeAdapter, ValidationError
    except ImportError as error:
        raise SettingsError(
            f"the DeepSpeed configuration's {key}.enabled is {json.dumps(value)}, which needs DeepSpeed (and its "
            f"pydantic) to read ({error}): pip install deepspeed (or memplan[deepspeed]), or give true or false"
        ) from error
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        raise SettingsError(
            f"the DeepSpeed configuration's {key}.enabled is {json.dumps(value)}, which DeepSpeed refuses: give "
            'true, false or "auto"'
        ) from None


def _section(config: dict[str, Any], key: str) -> Any:
    """The section DeepSpeed reads for key: "bfloat16" only where "bf16" is absent or null (get_bfloat16_config);
    None where the file has none."""
    if key == "bfloat16":
        return config.get("bfloat16") if config.get("bf16") is None else None
    return config.get(key)


def _not_a_section(key: str, section: Any) -> SettingsError:
    return SettingsError(
        f'the DeepSpeed configuration\'s "{key}" is {json.dumps(section)}, where DeepSpeed takes a section such as '
        f'{{"enabled": true}}: give one'
    )


def _precision_enabled(config: dict[str, Any], key: str) -> bool:
    """Whether DeepSpeed runs the bf16 or fp16 section's precision; "auto", which the Trainer fills from its own
    arguments (and DeepSpeed alone reads as false), is not an answer of the file's."""
    section = _section(config, key)
    if section is None:
        return False
    if not isinstance(section, dict):
        raise _not_a_section(key, section)
    value = section.get("enabled", False)
    if value == "auto":  # DeepSpeedConfigModel drops "auto" values before validating (runtime/config_utils.py)
        return False
    return _as_deepspeed_reads_it(key, value)


def _autocast_enabled(config: dict[str, Any]) -> bool:
    """Whether DeepSpeed opens torch.autocast: it reads torch_autocast's "enabled" raw and tests its truth
    (runtime/config.py get_torch_autocast_enabled; engine.py and torch_autocast.py `if
    engine.torch_autocast_enabled()`), so "auto", which no Trainer fills there, and even "false" turn it on."""
    section = config.get(AUTOCAST_SECTION)
    if section is None:
        return False
    if not isinstance(section, dict):
        raise _not_a_section(AUTOCAST_SECTION, section)
    modules = section.get("lower_precision_safe_modules")
    if modules is not None and not (isinstance(modules, list) and all(isinstance(name, str) for name in modules)):
        # DeepSpeed checks only that each item is a string, so a string passes and its letters are imported one by
        # one ("Failed to import lower precision safe module t").
        raise SettingsError(
            f"the DeepSpeed configuration's torch_autocast.lower_precision_safe_modules is {json.dumps(modules)}: "
            'give a list of class paths, such as ["torch.nn.Linear"]'
        )
    return bool(section.get("enabled", False))


def file_precision(config: dict[str, Any]) -> str | None:
    """The precision the configuration enables outright, as --precision names it ("bf16", "fp16", and "amp-bf16"
    or "amp-fp16" for torch_autocast in that dtype); None where it enables none or leaves it "auto". A
    torch_autocast without a 16-bit dtype is refused: without one, torch.autocast takes the device's default
    (float16 on a GPU, bfloat16 on a CPU), which memplan will not guess."""
    enabled = [key for key in PRECISION_SECTIONS if _precision_enabled(config, key)]
    if len({PRECISION_SECTIONS[key] for key in enabled}) > 1:
        # DeepSpeed asserts the same (runtime/config.py: "bfloat16 and fp16 modes cannot be simultaneously enabled").
        raise SettingsError(
            f"the DeepSpeed configuration enables both {enabled[0]} and {enabled[1]}, which DeepSpeed refuses: set "
            '"enabled" to false in one of them'
        )
    if _autocast_enabled(config):
        if enabled:
            # DeepSpeed runs both (a 16-bit model inside torch.autocast); memplan's --precision names one of them.
            raise SettingsError(
                f"the DeepSpeed configuration enables both {enabled[0]} and torch_autocast, which memplan does not "
                'trace together: set "enabled" to false in one of them'
            )
        dtype = config[AUTOCAST_SECTION].get("dtype")
        if not isinstance(dtype, str) or dtype not in AUTOCAST_PRECISION_OF_DTYPE:
            given = f"its dtype is {dtype!r}" if dtype is not None else "it gives no dtype"
            raise SettingsError(
                f'the DeepSpeed configuration enables torch_autocast, and {given}: give "dtype": "bfloat16" or '
                '"float16" in its torch_autocast section'
            )
        return AUTOCAST_PRECISION_OF_DTYPE[dtype]
    return PRECISION_SECTIONS[enabled[0]] if enabled else None


def _given(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def replaced_values(
    config: dict[str, Any], batch_size: int, grad_accum: int, world_size: int, optimizer: str
) -> list[str]:
    """The file's own batch, accumulation and optimizer where memplan's options replace them, each as
    "KEY VALUE (memplan: ...)"; empty where the file leaves them out, "auto", or agrees."""
    replaced = []
    expected = {
        "train_micro_batch_size_per_gpu": (batch_size, f"-b {batch_size}"),
        "gradient_accumulation_steps": (grad_accum, f"--grad-accum {grad_accum}"),
        "train_batch_size": (
            batch_size * grad_accum * world_size,
            f"{batch_size}×{grad_accum}×{world_size} = {batch_size * grad_accum * world_size}",
        ),
    }
    for key, (value, option) in expected.items():
        given = _given(config, key)
        if given is not None and given != value:
            replaced.append(f"{key} {given} ({option})")
    section = config.get("optimizer")
    kind = str(section.get("type", "")) if isinstance(section, dict) else ""
    if kind and not (kind.lower() in ADAM_KINDS and optimizer in ADAM_KINDS):
        replaced.append(f"optimizer {kind} (--optimizer {optimizer}, handed to DeepSpeed as the client optimizer)")
    return replaced


def parse_deepspeed_config(text: str) -> dict[str, Any]:
    """A DeepSpeed configuration's JSON text, as the object DeepSpeed takes; one line where it is not one."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise SettingsError(f"the DeepSpeed configuration is not JSON ({error})") from error
    if not isinstance(config, dict):
        raise SettingsError(
            f"the DeepSpeed configuration holds a JSON {type(config).__name__}, not an object as ds_config.json does"
        )
    return with_zero_section_read(config)


# DeepSpeed's offload devices (runtime/zero/offload_config.py, OffloadDeviceEnum), which it takes as written.
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


# DeepSpeed's deprecated offload switches and the sections they stand for (runtime/zero/config.py, DeepSpeedZeroConfig:
# `cpu_offload` and `cpu_offload_param`, each with a `new_param_fn` making a {"device": "cpu"} section of True and
# none of False; runtime/config_utils.py `_process_deprecated_field` asserts that no file gives both forms).
_DEPRECATED_OFFLOAD_KEYS = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _as_deepspeed_reads_a_switch(value: object, old: str, new: str) -> bool:
    """A deprecated switch's value as DeepSpeed's pydantic field (`Optional[bool]`) reads it: null, false, 0, "false"
    are off, true, 1, "true" on; what pydantic refuses is one line."""
    try:
        from pydantic import TypeAdapter, ValidationError
    except ImportError:  # DeepSpeed's own dependency: without it (no DeepSpeed here either), true, false and null
        TypeAdapter, ValidationError = None, ValueError
    try:
        if TypeAdapter is None:
            if value is not None and not isinstance(value, bool):
                raise ValueError(value)
            return bool(value)
        return bool(TypeAdapter(bool | None).validate_python(value))
    except ValidationError:
        raise SettingsError(
            f"the DeepSpeed configuration's zero_optimization.{old} is {json.dumps(value)}, where DeepSpeed takes "
            f'true or false: give one, or its replacement {new}: {{"device": "cpu"}}'
        ) from None


def _deprecated_offload_keys_replaced(zero: dict[str, Any]) -> None:
    """`zero` with each deprecated offload switch replaced by the section DeepSpeed makes of it, as DeepSpeed reads it:
    a file that still says `"cpu_offload": true` offloads, and is traced and measured as offloading (the validator
    had counted its host memory as the device's, 2× the prediction; a helper's bug hunt)."""
    for old, new in _DEPRECATED_OFFLOAD_KEYS.items():
        if old not in zero:
            continue
        value = zero.pop(old)
        if new in zero:
            raise SettingsError(
                f"the DeepSpeed configuration's zero_optimization gives {old} (deprecated) and {new} together, which "
                f"DeepSpeed refuses: keep {new}"
            )
        if _as_deepspeed_reads_a_switch(value, old, new):
            zero[new] = {"device": "cpu"}


def with_zero_section_read(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its zero_optimization section checked as DeepSpeed's pydantic models read it
    (runtime/zero/config.py, DeepSpeedZeroConfig; offload_config.py): a section where DeepSpeed takes one, its
    stage an integer from 0 to 3 (pydantic reads "2" and 2.0 as 2, and so does memplan: the stage is returned as
    an int), an offload section's device one of OFFLOAD_DEVICES and its ratio a number. What DeepSpeed would
    refuse is one line here, before memplan reads the section."""
    zero = config.get("zero_optimization")
    if zero is None:
        return config
    if not isinstance(zero, dict):
        raise SettingsError(
            f"the DeepSpeed configuration's zero_optimization is {json.dumps(zero)}, where DeepSpeed takes a section "
            'such as {"stage": 2}: give one'
        )
    zero = dict(zero)
    if "stage" in zero:
        zero["stage"] = _stage(zero["stage"])
    _deprecated_offload_keys_replaced(zero)
    for name in ("offload_optimizer", "offload_param"):
        section = zero.get(name)
        if section is None:
            continue
        where = f"zero_optimization.{name}"
        if not isinstance(section, dict):
            raise SettingsError(
                f"the DeepSpeed configuration's {where} is {json.dumps(section)}, where DeepSpeed takes a section "
                'such as {"device": "cpu"}: give one'
            )
        device = section.get("device", "none")
        if device is not None and device not in OFFLOAD_DEVICES:
            raise SettingsError(
                f"the DeepSpeed configuration's {where}.device is {json.dumps(device)}, which DeepSpeed refuses: "
                f'give "cpu" (or "none"; memplan does not trace "nvme")'
            )
        ratio = section.get("ratio", 1.0)
        if isinstance(ratio, bool) or not isinstance(ratio, int | float):
            raise SettingsError(
                f"the DeepSpeed configuration's {where}.ratio is {json.dumps(ratio)}, where DeepSpeed takes a "
                "number from 0 to 1: give one, or leave it out (1, the whole state)"
            )
    return {**config, "zero_optimization": zero}


def _stage(stage: Any) -> int:
    """zero_optimization.stage as DeepSpeed reads it (ZeroStageEnum, an int enum, through pydantic's lax mode):
    an integer, or a string or float that is one."""
    value = stage
    if isinstance(stage, str) and stage.strip().isdigit():
        value = int(stage)
    elif isinstance(stage, float) and stage.is_integer():
        value = int(stage)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
        raise SettingsError(
            f"the DeepSpeed configuration's zero_optimization.stage is {json.dumps(stage)}, which DeepSpeed refuses: "
            "give 0, 1, 2 or 3"
        )
    return value
