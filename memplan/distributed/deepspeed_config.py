"""The configuration memplan hands DeepSpeed's engine for one rank (memplan.distributed.deepspeed): the user's
file (`--deepspeed`, or `--hf-args`' deepspeed entry) with memplan's own batch, accumulation, precision and
optimizer in place of the file's, "auto" sizes filled as transformers fills them, and the offload sections set by
--offload. Pure: no torch.
"""

from __future__ import annotations

from typing import Any

from memplan.distributed.deepspeed_file import AUTOCAST_DTYPE_NAMES, AUTOCAST_SECTION
from memplan.errors import SettingsError

# Keys of a DeepSpeed configuration that memplan's own settings decide (batch, accumulation,
# precision, optimizer): the user's values for them are replaced.
MEMPLAN_SETS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "bf16",
    "bfloat16",  # bf16's older name, which DeepSpeed still reads
    "fp16",
    "torch_autocast",
    "zero_allow_untested_optimizer",
)
# transformers' HfDeepSpeedConfig fills "auto" sizes from the model's hidden size
# (integrations/deepspeed.py, trainer_config_finalize): reduce_bucket_size = hidden_size², and with
# stage 3 stage3_prefetch_bucket_size = int(0.9 × hidden_size²), stage3_param_persistence_threshold =
# 10 × hidden_size.
AUTO_FROM_HIDDEN_SIZE = {
    "reduce_bucket_size": lambda hidden: hidden * hidden,
    "stage3_prefetch_bucket_size": lambda hidden: int(0.9 * hidden * hidden),
    "stage3_param_persistence_threshold": lambda hidden: 10 * hidden,
}


def deepspeed_config(
    stage: int,
    batch_size: int,
    precision: str,
    user_config: dict[str, Any] | None,
    hidden_size: int | None = None,
    grad_accum: int = 1,
    offload: str = "none",
) -> dict:
    """The configuration the rank's engine is built with: the user's (`--deepspeed`), with the ZeRO
    stage, batch, accumulation, precision (torch_autocast for amp-*, its module list the user's) and
    optimizer set from memplan's settings, the
    "auto" values transformers would fill, and `offload_optimizer` on the host where `offload` is
    "optimizer" (--offload optimizer)."""
    config = {key: value for key, value in (user_config or {}).items() if key not in MEMPLAN_SETS}
    zero = dict(config.get("zero_optimization") or {})
    for key, value in list(zero.items()):
        if value != "auto":
            continue
        if key.startswith("stage3_") and (stage != 3 or key not in AUTO_FROM_HIDDEN_SIZE):
            del zero[key]  # stage 3's settings that size no buffer (or a stage that reads none): DeepSpeed's default
        elif key in AUTO_FROM_HIDDEN_SIZE and hidden_size is not None:
            zero[key] = AUTO_FROM_HIDDEN_SIZE[key](hidden_size)
        elif key in AUTO_FROM_HIDDEN_SIZE:  # a model without a hidden size in its config
            raise SettingsError(
                f'--deepspeed: zero_optimization.{key} is "auto", which transformers fills from the model\'s '
                "hidden size, and this model's config has none: give a number"
            )
        else:  # transformers fills no other key of the section (integrations/deepspeed.py): DeepSpeed refuses it
            raise SettingsError(
                f'--deepspeed: zero_optimization.{key} is "auto", which transformers does not fill (it fills '
                f"{', '.join(AUTO_FROM_HIDDEN_SIZE)}), and DeepSpeed refuses: give its value, or leave it out"
            )
    offload_optimizer = _offload_optimizer(zero, offload)
    if offload_optimizer is not None:
        zero["offload_optimizer"] = offload_optimizer
        # memplan's optimizer is the client optimizer, which DeepSpeed runs on the host when told it may
        # (engine.py, _configure_optimizer: DeepSpeedCPUAdam is required otherwise); where the job would run
        # DeepSpeedCPUAdam, the rank runs memplan's optimizer as it (DeepSpeedRank, runs_deepspeed_cpu_adam).
        config["zero_force_ds_cpu_optimizer"] = False
    offload_param = _offload_param(zero, offload, stage, offload_optimizer is not None)
    if offload_param is not None:
        zero["offload_param"] = offload_param
    zero["stage"] = stage
    config["zero_optimization"] = zero
    config["train_micro_batch_size_per_gpu"] = batch_size
    config["gradient_accumulation_steps"] = grad_accum  # the engine counts the micro-batches (after_micro_batch)
    config["bf16"] = {"enabled": precision == "bf16"}
    # fp16: DeepSpeed's own, a 16-bit model, float32 master partition and a dynamic loss scale (a
    # Python number it multiplies the loss by and divides the gradients by in the step).
    config["fp16"] = {"enabled": precision == "fp16"}
    if precision in AUTOCAST_DTYPE_NAMES:
        user_autocast = (user_config or {}).get(AUTOCAST_SECTION)
        config[AUTOCAST_SECTION] = {
            **(user_autocast if isinstance(user_autocast, dict) else {}),
            "enabled": True,
            "dtype": AUTOCAST_DTYPE_NAMES[precision],
        }
    # memplan hands DeepSpeed its optimizer as the client optimizer, as transformers' Trainer does, which
    # then allows optimizers DeepSpeed has not tested with ZeRO (integrations/deepspeed.py,
    # deepspeed_optim_sched): without it torch's Adafactor or bitsandbytes' 8-bit Adam fail an assertion.
    config["zero_allow_untested_optimizer"] = True
    return config


def runs_deepspeed_cpu_adam(user_config: dict[str, Any] | None) -> bool:
    """Whether a job offloading its optimizer steps with DeepSpeedCPUAdam: DeepSpeed requires it (or its
    CPU Adagrad or Lion) with offload_optimizer unless the configuration says `zero_force_ds_cpu_optimizer:
    false` (engine.py, _configure_optimizer), accelerate, and so transformers' Trainer, turns the
    Trainer's torch optimizer into it (accelerate/utils/deepspeed.py, map_pytorch_optim_to_deepspeed:
    DeepSpeedCPUAdam for all but Adagrad and bitsandbytes' 32-bit Lion), and DeepSpeed builds it from an
    "optimizer" section of the file."""
    return (user_config or {}).get("zero_force_ds_cpu_optimizer", True) is not False


def _offload_section(zero: dict[str, Any], name: str, forced: bool, moved: str) -> dict[str, Any] | None:
    """zero_optimization's `name` section ("offload_param" or "offload_optimizer") as the rank runs it: the
    user's, its device set to "cpu" where `forced` (by --offload); None where nothing leaves the GPU.
    NVMe (ZeRO-Infinity's swapping) is refused: memplan does not trace it."""
    section = dict(zero.get(name) or {})
    if forced:
        section["device"] = "cpu"
    device = section.get("device") or "none"
    if device == "none":
        return None
    if device != "cpu":
        raise SettingsError(
            f'--deepspeed: zero_optimization.{name} moves {moved} to "{device}" (ZeRO-Infinity), which memplan '
            f'does not trace: give "cpu", or remove {name}'
        )
    return section


def _offload_param(zero: dict[str, Any], offload: str, stage: int, offloads_optimizer: bool) -> dict[str, Any] | None:
    """The offload_param section: ZeRO-3's parameter partitions on the host, set by --offload params with the
    optimizer's state (the usual "ZeRO-3 offload" configuration)."""
    section = _offload_section(zero, "offload_param", offload == "params", "the parameters")
    if section is None:
        return None
    if stage != 3:
        raise SettingsError("--deepspeed: zero_optimization.offload_param is ZeRO-3's: give --parallel zero3")
    if not offloads_optimizer:
        raise SettingsError(
            "--deepspeed: zero_optimization.offload_param without offload_optimizer is not traced: offload both "
            '(device "cpu" in each, or --offload params)'
        )
    return section


def _offload_optimizer(zero: dict[str, Any], offload: str) -> dict[str, Any] | None:
    """The offload_optimizer section, set by --offload optimizer (and params). A partial offload (`ratio`
    below 1, which keeps some sub-groups' state on the GPU, or `super_offload`) is refused."""
    section = _offload_section(zero, "offload_optimizer", offload in ("optimizer", "params"), "the optimizer state")
    if section is not None and (float(section.get("ratio", 1.0)) != 1.0 or section.get("super_offload")):
        raise SettingsError(
            "--deepspeed: zero_optimization.offload_optimizer offloads part of the optimizer (ratio below 1, or "
            "super_offload), which memplan does not trace: leave them out for the whole state on the host"
        )
    return section
