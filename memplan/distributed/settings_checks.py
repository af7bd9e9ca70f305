"""The checks of a data-parallel job's settings: the strategy, its world and shard sizes, offload, DeepSpeed's
file and NCCL's variables. Called by TrainingSettings as it is made (memplan.settings)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.choices import MAX_COUNT, check_choice, check_positive, options_given
from memplan.distributed.deepspeed_file import AUTOCAST_DTYPE_NAMES, AUTOCAST_SECTION, file_precision
from memplan.distributed.modes import (
    DATA_PARALLEL_MODES,
    DDP_MODES,
    DEEPSPEED_MODE_OF_STAGE,
    DEEPSPEED_MODES,
    FSDP_MIXED_PRECISIONS,
    FSDP_MODES,
    OFFLOAD_MODES,
    PARALLEL_MODES,
)
from memplan.errors import SettingsError

if TYPE_CHECKING:
    from memplan.settings import TrainingSettings


def check_parallel(settings: TrainingSettings) -> None:
    """The data-parallel settings (--parallel and what only it configures), checked as TrainingSettings is made."""
    check_choice("parallel mode", settings.parallel, PARALLEL_MODES)
    check_positive("world size", settings.world_size)
    if settings.world_size > MAX_COUNT:
        raise SettingsError(f"world size {settings.world_size:,} is beyond what memplan models (at most {MAX_COUNT:,})")
    if settings.ddp_bucket_view and settings.parallel not in DDP_MODES:
        raise SettingsError("--ddp-bucket-view is an option of DDP: give --parallel ddp or zero1")
    if settings.parallel == "zero1" and settings.optimizer == "none":
        raise SettingsError("--parallel zero1 shards the optimizer's state, and --optimizer none has none: give one")
    _check_shard_size(settings)
    _check_offload(settings)
    if settings.fsdp_mixed_precision is not None:
        check_choice("FSDP2 mixed precision", settings.fsdp_mixed_precision, FSDP_MIXED_PRECISIONS)
        if settings.parallel not in FSDP_MODES:
            raise SettingsError("--fsdp-mixed-precision is FSDP2's policy: give --parallel fsdp, fsdp-grad-op or hsdp")
        if settings.precision in ("bf16", "fp16"):
            raise SettingsError(
                f"--fsdp-mixed-precision casts float32 parameters, and --precision {settings.precision} stores them in "
                f"{settings.precision}: give --precision fp32 (or amp-bf16, amp-fp16) with it"
            )
    _check_deepspeed(settings)
    if settings.parallel in FSDP_MODES and settings.optimizer == "adafactor":
        # torch 2.13's Adafactor on FSDP2's DTensors: "aten.pow_.Scalar: in-place operations that require
        # placement changes are not supported" (its row/column norms are Partial), in a real run as in a trace.
        raise SettingsError(
            f"--parallel {settings.parallel} with --optimizer adafactor: torch's Adafactor does not run on FSDP2's "
            "sharded parameters (an in-place op on a partial DTensor); use adamw, adam, sgd or adam8bit"
        )
    if settings.parallel in FSDP_MODES and settings.quantize is not None:
        raise SettingsError(
            f"--parallel {settings.parallel} with --quantize: FSDP2 over bitsandbytes' quantized layers is not traced "
            "yet; leave out one of them"
        )
    _check_nccl(settings)
    if settings.parallel == "none" and settings.world_size != 1:
        raise SettingsError(
            f"--world-size {settings.world_size} counts data-parallel ranks: give --parallel {DATA_PARALLEL_MODES}, "
            "or leave it out"
        )


def _check_shard_size(settings: TrainingSettings) -> None:
    if settings.shard_size is not None and settings.parallel != "hsdp":
        raise SettingsError("--shard-size is HSDP's: give --parallel hsdp with it")
    if settings.parallel != "hsdp":
        return
    if settings.shard_size is None:
        raise SettingsError(
            "--parallel hsdp shards within groups of ranks and replicates across them: give --shard-size S, "
            "the ranks each group spans (a divisor of --world-size; 8 for one node of 8 GPUs)"
        )
    check_positive("shard size", settings.shard_size)
    if settings.world_size % settings.shard_size:
        raise SettingsError(
            f"--shard-size {settings.shard_size} does not divide --world-size {settings.world_size}: HSDP runs "
            "world-size / shard-size replicas of one shard group"
        )


def _check_offload(settings: TrainingSettings) -> None:
    check_choice("offload", settings.offload, OFFLOAD_MODES)
    if settings.deepspeed_stage is not None:
        if settings.offload == "params" and settings.deepspeed_stage != 3:
            raise SettingsError(
                f"--offload params with --parallel {settings.parallel}: DeepSpeed offloads parameters at stage 3 "
                "(offload_param): give --parallel zero3, or --offload optimizer"
            )
        # --offload adds to what the --deepspeed file offloads by itself (deepspeed_config): the settings (their
        # JSON, compare's rows) name what the rank runs.
        object.__setattr__(settings, "offload", _deepspeed_offload(settings))
        return
    if settings.offload == "none":
        return
    if settings.parallel not in FSDP_MODES:
        raise SettingsError(
            "--offload moves sharded state to host memory: give --parallel fsdp, fsdp-grad-op or hsdp "
            "(--offload params), or zero2, zero3, or zero1 with a --deepspeed file (--offload optimizer) with it"
        )
    if settings.offload == "optimizer":
        raise SettingsError(
            "FSDP2 offloads the parameters, their gradients and the optimizer state together "
            "(CPUOffloadPolicy): give --offload params"
        )
    if settings.step is not None:
        raise SettingsError("--offload with --step is not traced yet: leave out one of them")


def _deepspeed_offload(settings: TrainingSettings) -> str:
    """What a DeepSpeed rank puts on the host, as --offload names it: "params" where ZeRO-3 offloads both the
    parameters and the optimizer, "optimizer" where the optimizer alone, by --offload or by the file's own
    sections. A file's offload_param without any offload of the optimizer keeps "none" here, so that
    deepspeed_config's own message refuses it."""
    if not settings.offloads_to_host:
        return "none"
    return "params" if settings.deepspeed_offloads_parameters else "optimizer"


def _check_deepspeed(settings: TrainingSettings) -> None:
    if settings.deepspeed_config is not None and settings.parallel not in (*DEEPSPEED_MODES, "zero1"):
        raise SettingsError(
            "--deepspeed (or a deepspeed entry in --hf-args) configures DeepSpeed's ZeRO: give --parallel zero1, "
            "zero2 or zero3 with it"
        )
    traced = settings.deepspeed_stage
    if traced is None:
        return
    option = f"--parallel {settings.parallel}"
    if settings.deepspeed_config is not None:
        stage = (settings.deepspeed_settings.get("zero_optimization") or {}).get("stage")
        if stage not in (None, traced):
            mode = DEEPSPEED_MODE_OF_STAGE.get(stage)
            instead = f"give --parallel {mode}" if mode else "memplan traces stages 1 to 3"
            raise SettingsError(f"--deepspeed sets ZeRO stage {stage}; {option} traces stage {traced}: {instead}")
    if settings.optimizer == "none":
        raise SettingsError(f"{option} partitions the optimizer's state, and --optimizer none has none: give one")
    _check_file_precision(settings)
    unsupported = options_given(
        ("--step", settings.step, None),
        ("--quantize", settings.quantize, None),
        ("--loop", settings.loop, "canonical"),
    )
    if unsupported:
        raise SettingsError(
            f"{option} with {unsupported[0]}: DeepSpeed runs its own loop (engine.backward, engine.step), and "
            "memplan traces it as accelerate runs it (the canonical loop), unquantized; leave it out"
        )


def _check_file_precision(settings: TrainingSettings) -> None:
    """The precision a DeepSpeed configuration enables outright must be --precision's, as the Trainer stops on
    a file that mismatches its arguments (memplan.distributed.deepspeed_file)."""
    enabled = file_precision(settings.deepspeed_settings)
    if enabled is not None and enabled != settings.precision:
        if enabled.startswith("amp-"):
            # transformers fills bf16's and fp16's "auto" from its arguments, not torch_autocast's, which
            # DeepSpeed would read as enabled: the file itself must say what the job runs.
            raise SettingsError(
                f"the DeepSpeed configuration enables {AUTOCAST_SECTION} in {AUTOCAST_DTYPE_NAMES[enabled]}, and "
                f"--precision is {settings.precision}: give --precision {enabled}, or change the file's "
                f'{AUTOCAST_SECTION} section (its dtype, or "enabled": false) to what the job runs'
            )
        raise SettingsError(
            f"the DeepSpeed configuration enables {enabled}, and --precision is {settings.precision}: give --precision "
            f'{enabled}, or set "enabled" in the file\'s {enabled} section to "auto" to take --precision\'s'
        )


def _check_nccl(settings: TrainingSettings) -> None:
    given = options_given(
        ("--nccl-memory", settings.nccl_memory, None),
        ("--nccl-buffsize (NCCL_BUFFSIZE)", settings.nccl_buffsize, None),
        ("--nccl-max-ctas (NCCL_MAX_CTAS)", settings.nccl_max_ctas, None),
        ("--no-nccl-nvls (NCCL_NVLS_ENABLE=0)", settings.nccl_nvls, True),
    )
    if given and settings.parallel == "none":
        raise SettingsError(
            f"{given[0]} sizes what NCCL holds on one GPU of a data-parallel job: give --parallel "
            f"{DATA_PARALLEL_MODES} on the cuda target"
        )
    if given and settings.device != "cuda":
        raise SettingsError(
            f"{given[0]} sizes what NCCL holds on one GPU, and --device {settings.device} traces no GPU: drop it, "
            "or leave out --device cpu"
        )
    if settings.nccl_memory is not None and settings.nccl_memory < 0:
        raise SettingsError(f"NCCL memory must be 0 or more bytes, got {settings.nccl_memory}")
    check_positive("NCCL buffer size (NCCL_BUFFSIZE)", settings.nccl_buffsize)
    check_positive("NCCL channel cap (NCCL_MAX_CTAS)", settings.nccl_max_ctas)
