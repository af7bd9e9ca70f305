"""The data-parallel strategies memplan traces, and what each of them is (`--parallel`, `--offload`)."""

from __future__ import annotations

# Data parallelism, per rank (memplan.distributed): "none" (one process), torch's DDP, DDP with the
# optimizer state sharded by torch's ZeroRedundancyOptimizer ("zero1"), or FSDP2's fully_shard
# resharding after the forward ("fsdp") or only after the backward ("fsdp-grad-op"), or hybrid: sharded
# within groups of --shard-size ranks and replicated across them ("hsdp"), or DeepSpeed's own ZeRO stage 2
# or 3 ("zero2", "zero3": memplan/distributed/deepspeed.py).
PARALLEL_MODES = ("none", "ddp", "zero1", "fsdp", "fsdp-grad-op", "hsdp", "zero2", "zero3")
DDP_MODES = ("ddp", "zero1")  # DistributedDataParallel wraps the model
# The modes with ranks, as messages list them: "ddp, zero1, ... or zero3".
DATA_PARALLEL_MODES = f"{', '.join(PARALLEL_MODES[1:-1])} or {PARALLEL_MODES[-1]}"
FSDP_MODES = ("fsdp", "fsdp-grad-op", "hsdp")
RESHARDING_FSDP_MODES = ("fsdp", "hsdp")  # reshard_after_forward=True
# --offload: "params" is FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer state on the
# host, the optimizer step run there) or, with zero3, DeepSpeed's offload_param beside its offload_optimizer;
# "optimizer" is DeepSpeed's offload_optimizer (the float32 master partition, its gradient and the optimizer
# state on the host, the step run there).
OFFLOAD_MODES = ("none", "optimizer", "params")
DEEPSPEED_STAGES = {"zero2": 2, "zero3": 3}  # DeepSpeed's engine wraps the model and the optimizer
DEEPSPEED_MODES = tuple(DEEPSPEED_STAGES)
# The --parallel mode of each ZeRO stage DeepSpeed runs: stage 1 is `zero1` with a --deepspeed file
# (without one, `zero1` is torch's ZeroRedundancyOptimizer; TrainingSettings.deepspeed_stage).
DEEPSPEED_MODE_OF_STAGE = {1: "zero1", **{stage: mode for mode, stage in DEEPSPEED_STAGES.items()}}
# FSDP2's MixedPrecisionPolicy param_dtype choices (reduce_dtype float32, as torchtitan's default).
FSDP_MIXED_PRECISIONS = ("bf16", "fp16")
