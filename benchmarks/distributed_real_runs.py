"""One rank of DeepSpeed's ZeRO stages (and their optimizer offload), of HSDP and of FSDP2's CPU offload, predicted
beside the real CPU run: the figures the docs quote that the tests assert only within a tolerance or leave out (to
keep the suite short).

    python benchmarks/distributed_real_runs.py

The real run is the tests' hand-built one (tests/deepspeed_models.py, tests/fsdp_models.py: the job's
own engine or fully_shard on torch's fake process group, rank 0, measured by the CPU allocator's own
events in the third iteration; in bf16, whose real runs peak in a CPU matmul's scratch that no
dispatch mode sees, the CPU validator's storage count of the real run, memplan.measure.cpu); memplan's
side is `memplan.estimate` of the same model, batch and settings. Each line: the case, measured bytes,
predicted bytes, and the difference. A few seconds per case on a 2-core machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' harnesses

import memplan  # noqa: E402
from memplan.settings import TrainingSettings  # noqa: E402
from tests import deepspeed_models, fsdp_models  # noqa: E402
from tests.test_distributed_deepspeed import (  # noqa: E402
    MODELS,
    SMALL_BUCKET,
    STAGES,
    _estimate,
    offloading_rank,
)
from tests.test_distributed_fsdp import SOURCE  # noqa: E402
from tests.two_layer_mlp import mean_square  # noqa: E402

PARALLEL_OF_STAGE = {stage: parallel for parallel, stage in STAGES.items()}
STACK = "tests.fsdp_models:stack"


def deepspeed_case(stage: int, name: str, world_size: int, precision: str, grad_accum: int) -> tuple[int, int]:
    _, _, factory, make_batch, batch_size = MODELS[name]
    config = deepspeed_models.deepspeed_config(stage, batch_size, precision, SMALL_BUCKET, grad_accum=grad_accum)
    measured = deepspeed_models.measured_peak(factory, make_batch, mean_square, world_size, config)
    parallel = PARALLEL_OF_STAGE[stage]
    predicted = _estimate(name, world_size, precision, SMALL_BUCKET, parallel, grad_accum=grad_accum)
    return measured, predicted.peak_bytes


def counted_case(stage: int, world_size: int) -> tuple[int, int]:
    """bf16, where the real run's allocator events include a CPU matmul's scratch no dispatch mode sees:
    the real run counted by the CPU validator's storage counter (memplan.measure.cpu) instead."""
    import json

    from memplan.measure.cpu import measure_cpu
    from memplan.models.source import resolve_model

    reference, inputs, *_ = MODELS["stack-bf16"]
    spec = resolve_model(reference, inputs=inputs, loss="tests.two_layer_mlp:mean_square")
    parallel = PARALLEL_OF_STAGE[stage]
    settings = TrainingSettings(
        batch_size=16,
        device="cpu",
        parallel=parallel,
        world_size=world_size,
        precision="bf16",
        optimizer="adamw",
        deepspeed_config=json.dumps({"zero_optimization": SMALL_BUCKET}),
    )
    counted = measure_cpu(spec, spec.settings_for(settings)).peak_bytes
    return counted, _estimate("stack-bf16", world_size, "bf16", SMALL_BUCKET, parallel).peak_bytes


def hsdp_case(world_size: int, shard_size: int, checkpoint: str, grad_accum: int) -> tuple[int, int]:
    measured = fsdp_models.measured_peak(
        world_size, 16, True, checkpoint == "all", grad_accum=grad_accum, shard_size=shard_size
    )
    options = {"world_size": world_size, "shard_size": shard_size, "checkpoint": checkpoint, "grad_accum": grad_accum}
    predicted = memplan.estimate(STACK, **SOURCE, batch_size=16, device="cpu", parallel="hsdp", **options)
    return measured, predicted.peak_bytes


def offload_case(world_size: int, parallel: str, checkpoint: str, grad_accum: int, figure: str) -> tuple[int, int]:
    """FSDP2's CPU offload: `figure` "device" (the GPU's peak) or "host" (host_peak_bytes), against the
    real run's allocator events told apart (tests/fsdp_models.measured_offload_peaks)."""
    device, host, _ = fsdp_models.measured_offload_peaks(
        world_size, 16, parallel == "fsdp", checkpoint == "all", grad_accum
    )
    options = {"parallel": parallel, "world_size": world_size, "checkpoint": checkpoint, "grad_accum": grad_accum}
    predicted = memplan.estimate(STACK, **SOURCE, batch_size=16, device="cpu", offload="params", **options)
    return (device, predicted.peak_bytes) if figure == "device" else (host, predicted.host_peak_bytes)


def deepspeed_offload_case(
    stage: int, name: str, world_size: int, precision: str, grad_accum: int, figure: str
) -> tuple[int, int]:
    """DeepSpeed's offload_optimizer with torch's AdamW as the client optimizer on the host: `figure` "device"
    or "host", against the real run's allocator events told apart (tests/deepspeed_models.measured_offload_peaks).
    In bf16 the real run's device peak includes the CPU matmul's scratch (module docstring)."""
    parallel = PARALLEL_OF_STAGE[stage]
    predicted, (device, host) = offloading_rank(parallel, name, world_size, grad_accum, "optimizer", None, precision)
    return (device, predicted.peak_bytes) if figure == "device" else (host, predicted.host_peak_bytes)


Case = tuple[str, Callable[[], tuple[int, int]]]  # label, run
CASES: list[Case] = [
    ("ZeRO-2 stack, 4 ranks, 3 micro-batches", lambda: deepspeed_case(2, "stack", 4, "fp32", 3)),
    ("ZeRO-2 stack fp16, 4 ranks", lambda: deepspeed_case(2, "stack-fp16", 4, "fp16", 1)),
    ("ZeRO-1 MLP, 8 ranks", lambda: deepspeed_case(1, "two-layer", 8, "fp32", 1)),
    ("ZeRO-1 stack fp16, 4 ranks", lambda: deepspeed_case(1, "stack-fp16", 4, "fp16", 1)),
    ("ZeRO-1 stack bf16, 4 ranks (the validator's count)", lambda: counted_case(1, 4)),
    ("ZeRO-3 stack bf16, 4 ranks (the validator's count)", lambda: counted_case(3, 4)),
    ("ZeRO-3 stack bf16, 8 ranks (the validator's count)", lambda: counted_case(3, 8)),
    ("ZeRO-3 stack fp16, 2 ranks", lambda: deepspeed_case(3, "stack-fp16", 2, "fp16", 1)),
    ("ZeRO-3 stack fp16, 4 ranks", lambda: deepspeed_case(3, "stack-fp16", 4, "fp16", 1)),
    ("HSDP stack, 8 ranks of 2, checkpointed", lambda: hsdp_case(8, 2, "all", 1)),
    ("HSDP stack, 6 ranks of 3", lambda: hsdp_case(6, 3, "none", 1)),
    *(
        (f"HSDP stack, 8 ranks of {shard}, 2 micro-batches", lambda shard=shard: hsdp_case(8, shard, "none", 2))
        for shard in (2, 4, 8)
    ),
    # Stage 1 with accumulation (tests/test_distributed_deepspeed.py asserts them within 32 B).
    ("ZeRO-1 stack, 2 ranks, 3 micro-batches", lambda: deepspeed_case(1, "stack", 2, "fp32", 3)),
    ("ZeRO-1 stack fp16, 2 ranks, 2 micro-batches", lambda: deepspeed_case(1, "stack-fp16", 2, "fp16", 2)),
    *(
        (
            f"FSDP2 offload stack, {world_size} ranks, {parallel}, checkpoint {checkpoint}, {accum} micro-batches, "
            f"{figure}",
            lambda case=(world_size, parallel, checkpoint, accum, figure): offload_case(*case),
        )
        for world_size, parallel, checkpoint, accum in ((2, "fsdp", "none", 1), (4, "fsdp-grad-op", "all", 2))
        for figure in ("device", "host")
    ),
    *(
        (
            f"DeepSpeed offload ZeRO-{stage} {name}, {world_size} ranks, {accum} micro-batches, {figure}",
            lambda case=(stage, name, world_size, precision, accum, figure): deepspeed_offload_case(*case),
        )
        for stage, name, world_size, precision, accum in (
            (2, "stack", 2, "fp32", 2),
            (3, "stack", 2, "fp32", 3),
            (2, "stack-bf16", 2, "bf16", 1),
            (2, "stack-bf16", 4, "bf16", 1),
        )
        for figure in ("device", "host")
    ),
]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for label, run in CASES:
        measured, predicted = run()
        print(
            f"{label}: measured {measured:,} B, predicted {predicted:,} B, {predicted - measured:+,} B "
            f"({(predicted - measured) / measured:+.2%})",
            flush=True,
        )


if __name__ == "__main__":
    main()
