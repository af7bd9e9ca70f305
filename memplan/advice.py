"""What to change when not even batch size 1 fits: advice that follows from where the memory goes.

Checkpointing only lowers activations, so it is advice only when activations are the problem:
- parameters and optimizer state alone over the budget: no batch size fits one GPU as configured;
  keep less state (8-bit Adam, Adafactor), store weights in bf16, or shard across GPUs (FSDP2);
- the optimizer step's peak over the budget (gradients + optimizer temporaries, the same at every
  batch size): the optimizer's implementation and state, not the batch, decide;
- DeepSpeed's buckets making most of the peak: their sizes in its configuration decide;
- otherwise the forward/backward peak: activations, which checkpointing, autocast and a shorter
  sequence or smaller image lower.
"""

from __future__ import annotations

from memplan.checkpoint_layout import CheckpointLayout
from memplan.distributed.modes import DDP_MODES, FSDP_MODES
from memplan.estimator.result import EstimateResult
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes


def _state_options(result: EstimateResult) -> list[str]:
    settings = result.settings
    options = []
    # Optimizer state worth shrinking: at least a quarter of the weights' bytes (full Adam keeps two
    # moments per weight; LoRA's adapters are a sliver of the model).
    if settings.optimizer in ("adam", "adamw") and 4 * result.breakdown.optimizer_state >= result.breakdown.parameters:
        options.append("--optimizer adam8bit or adafactor (less optimizer state)")
    if settings.lora_rank is None and result.trainable_parameter_count:
        options.append("--lora RANK (train adapters: the weights get no gradients or optimizer state)")
    elif settings.lora_rank is not None and settings.quantize is None:
        options.append("--quantize nf4 (QLoRA: the frozen weights in 4 bits)")
    if settings.precision in ("fp32", "amp-bf16", "amp-fp16"):
        options.append("--precision bf16 (weights, gradients and state in 16 bits)")
    if result.breakdown.communication and settings.parallel in DDP_MODES:
        options.append("--ddp-bucket-view (DDP's gradient_as_bucket_view: no second copy of the gradients)")
    return options


def _sharding(settings: TrainingSettings) -> str:
    offload = (
        ", or --offload optimizer (DeepSpeed's offload_optimizer: master weights, their gradients and optimizer "
        "state in host memory)"
        if settings.deepspeed_stage is not None and not settings.offloads_to_host
        else ""
    )
    if settings.parallel in FSDP_MODES and settings.offload == "none":
        return (
            "more ranks (--world-size: each holds a smaller shard), or --offload params (the shards, gradients and "
            "optimizer state in host memory)"
        )
    if settings.parallel in FSDP_MODES:
        return "more ranks (--world-size: each holds a smaller shard)"
    if settings.parallel == "ddp":
        return (
            "--parallel zero1 (each rank keeps its share of the optimizer state) or fsdp (parameters, gradients and "
            "optimizer state sharded) on the same ranks"
        )
    if settings.parallel == "zero1":
        return (
            "--parallel fsdp on the same ranks (parameters and gradients sharded too, not only the optimizer state)"
            f"{offload}"
        )
    if settings.parallel == "zero2":
        return (
            "--parallel zero3 or fsdp on the same ranks (the parameters sharded too, not only gradients and optimizer "
            f"state){offload}"
        )
    if settings.parallel == "zero3":
        parameters = (
            ", or --offload params (offload_param too: the parameter partitions in host memory)"
            if not settings.deepspeed_offloads_parameters
            else ""
        )
        return (
            "more ranks (a larger --world-size: ZeRO-3 divides parameters, gradients and optimizer state by it)"
            f"{offload}{parameters}"
        )
    return "--parallel fsdp --world-size N (FSDP2 shards parameters, gradients and optimizer state across N GPUs)"


def when_nothing_fits(result: EstimateResult, budget_bytes: int) -> str:
    """One line for a budget that not even batch size 1 meets."""
    settings = result.settings
    state = result.breakdown.parameters + result.breakdown.optimizer_state
    if state >= budget_bytes:
        options = [*_state_options(result), _sharding(settings)]
        return (
            f"parameters and optimizer state alone take {format_bytes(state)} of the {format_bytes(budget_bytes)} "
            f"budget, so no batch size fits one {'GPU' if settings.device == 'cuda' else 'device'} as configured: "
            f"try {'; '.join(options)}"
        )
    workspaces = result.breakdown.workspaces
    if settings.device == "cuda" and 2 * workspaces >= result.peak_bytes:
        # Library workspaces, not tensors, make most of the peak (a small model): no batch size or checkpointing
        # changes them; the switches that size them do (memplan.estimator.cuda.cublas, .cudnn).
        options = [
            "--cublas-workspace-config :16:8 (cuBLAS's workspaces, one per thread that multiplies matrices: "
            "8 of 16 KiB each)"
        ]
        if result.conv_workspace_free_peak_bytes is not None:
            options.append("--cudnn-workspace-cap MIB (each convolution's cuDNN workspace)")
        return (
            f"workspaces take {format_bytes(workspaces)} of the {format_bytes(result.peak_bytes)} peak, the same at "
            f"every batch size: try {'; '.join(options)}"
        )
    communication = result.breakdown.communication
    if settings.deepspeed_stage is not None and 2 * communication >= result.peak_bytes:
        # DeepSpeed's buckets are sized in elements by its configuration (zero_optimization.reduce_bucket_size,
        # 500,000,000 by default: runtime/zero/config.py), not by the batch or the activations.
        prefetch = ", and stage3_prefetch_bucket_size" if settings.deepspeed_stage == 3 else ""
        return (
            f"DeepSpeed's buckets take {format_bytes(communication)} of the {format_bytes(result.peak_bytes)} peak, "
            f"the same at every batch size: give a --deepspeed file with a smaller zero_optimization."
            f"reduce_bucket_size{prefetch} (elements; DeepSpeed's default is 500,000,000)"
        )
    # On cuda a budget must hold what the step completes in, the allocator's rounding and segments included: the
    # phases' live bytes are compared with what is left of it after that.
    overhead = max((result.smallest_device_bytes or result.peak_bytes) - result.peak_bytes, 0)
    if result.phase_peak_bytes.get("optimizer", 0) + overhead >= budget_bytes:
        options = _state_options(result)
        if settings.optimizer_impl != "for-loop" and settings.optimizer not in ("sgd", "none"):
            options.insert(0, "--optimizer-impl for-loop (no foreach temporaries)")
        return (
            f"the optimizer step alone peaks at {format_bytes(result.phase_peak_bytes['optimizer'])} (gradients and "
            "its temporaries, the same at every batch size; checkpointing does not lower it): try "
            + "; ".join(options or [_sharding(settings)])
        )
    options = []
    checkpointed = isinstance(settings.checkpoint, CheckpointLayout) or settings.checkpoint != "none"
    if not checkpointed:
        options.append("--checkpoint all (or `memplan plan`)")
    if settings.precision == "fp32":
        options.append("--precision amp-bf16")
    if settings.seq_len:
        options.append("a shorter --seq-len")
    elif settings.image_size:
        options.append("a smaller --image-size")
    options += _state_options(result)
    return "activations make the peak: try " + "; ".join(options)
