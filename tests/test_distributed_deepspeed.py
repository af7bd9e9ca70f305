"""`--parallel zero2|zero3` (memplan.distributed.deepspeed): one rank of DeepSpeed's ZeRO stage 2 or 3, traced.

Truth: DeepSpeed's own engine run for real on the CPU, on rank 0 of torch's fake process group, and
measured by torch's CPU allocator's own allocation and free events (tests/deepspeed_models.py, built
without memplan); DeepSpeed's documented default bucket size (500,000,000 elements) and transformers'
"auto" rule (hidden_size²) for the bucket lines."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import memplan
from memplan.cli import main
from memplan.distributed.modes import DEEPSPEED_STAGES
from memplan.errors import SettingsError
from tests import deepspeed_models, fsdp_models
from tests.hand_measure import checkpoint_each
from tests.two_layer_mlp import mean_square, rows, two_layer

MODELS = {  # model, --inputs, and the same two for the hand-built run; batch size
    "two-layer": ("tests.two_layer_mlp:two_layer", "tests.two_layer_mlp:rows", two_layer, rows, 4),
    "stack": ("tests.fsdp_models:stack", "tests.fsdp_models:rows", fsdp_models.stack, fsdp_models.rows, 16),
    "stack-bf16": (
        "tests.fsdp_models:stack",
        "tests.deepspeed_models:bf16_rows",
        fsdp_models.stack,
        deepspeed_models.bf16_rows,
        16,
    ),
    "stack-fp16": (
        "tests.fsdp_models:stack",
        "tests.deepspeed_models:fp16_rows",
        fsdp_models.stack,
        deepspeed_models.fp16_rows,
        16,
    ),
}
STAGES = {**DEEPSPEED_STAGES, "zero1": 1}  # zero1 with a --deepspeed file: DeepSpeed's own stage 1
SMALL_BUCKET = {"reduce_bucket_size": 20_000}  # elements: a bucket that fills and is reduced several times
DEEPSPEED_DEFAULT_BUCKET = 500_000_000  # elements (deepspeed/runtime/zero/config.py, reduce_bucket_size)


def _estimate(
    name: str, world_size: int, precision: str = "fp32", zero: dict | None = None, parallel: str = "zero2", **options
):
    reference, inputs, *_, batch_size = MODELS[name]
    config = {"zero_optimization": zero} if zero is not None else None
    return memplan.estimate(
        reference,
        inputs=inputs,
        loss="tests.two_layer_mlp:mean_square",
        batch_size=batch_size,
        device="cpu",
        optimizer="adamw",
        precision=precision,
        parallel=parallel,
        world_size=world_size,
        deepspeed_config=config,
        **options,
    )


@functools.cache
def _traced_once(name: str, world_size: int, precision: str, zero: str | None, parallel: str, options: tuple):
    return _estimate(name, world_size, precision, json.loads(zero) if zero else None, parallel, **dict(options))


def _predicted(
    name: str, world_size: int, precision: str = "fp32", zero: dict | None = None, parallel: str = "zero2", **options
):
    """_estimate's answer, traced once per process for the tests that only read it: several tests ask for the same
    rank (8 of the file's 74 traces, 2-4 s each, repeated one an earlier test had made). The tests of what the call
    itself does to the process (its group, torch's linear, an import that fails) call _estimate."""
    zero_key = json.dumps(zero, sort_keys=True) if zero is not None else None
    return _traced_once(name, world_size, precision, zero_key, parallel, tuple(sorted(options.items())))


def _measured(name: str, world_size: int, precision: str = "fp32", zero: dict | None = None, stage: int = 2) -> int:
    _, _, factory, make_batch, batch_size = MODELS[name]
    config = deepspeed_models.deepspeed_config(stage, batch_size, precision, zero)
    return deepspeed_models.measured_peak(factory, make_batch, mean_square, world_size, config)


FP32_CASES = [("two-layer", 2, "fp32"), ("two-layer", 8, "fp32"), ("stack", 2, "fp32"), ("stack", 4, "fp32")]


@pytest.mark.parametrize(
    ("parallel", "name", "world_size", "precision"),
    [
        *(("zero2", *case) for case in [*FP32_CASES, ("stack-bf16", 4, "bf16")]),
        *(("zero3", *case) for case in FP32_CASES),
        # seven ranks: every bucket's reduce-scatter pads (memplan.distributed.deepspeed_collectives' stand-in)
        ("zero3", "stack", 7, "fp32"),
        ("zero3", "stack-fp16", 8, "fp16"),  # its peak is in the forward (-55,408 B while the real run skipped steps)
        ("zero1", "stack", 2, "fp32"),
        # DeepSpeed's torch_autocast: a float32 model whose forward the engine runs in torch.autocast, gradients of
        # the modules it lists reduced in 16 bits, float16's loss scaled by torch's GradScaler in the ZeRO optimizer
        ("zero2", "stack", 2, "amp-bf16"),
        ("zero1", "stack", 2, "amp-fp16"),
        # ZeRO-3's linear is a Python autograd Function: its backward drops its incoming gradient before the
        # engine casts the float16 weight gradient it returns to float32 (+2,551 B when counted through the cast)
        ("zero3", "two-layer", 2, "amp-fp16"),
        # ... and casts the weight into the cache of an autocast region of its own, freed inside the formula
        # (+32,567 B when held to the formula's end)
        ("zero3", "stack", 4, "amp-fp16"),
    ],
)
def test_a_deepspeed_rank_is_the_real_deepspeed_run(parallel, name, world_size, precision):
    """ZeRO-3 gathers each module's parameters before it runs and releases them after, except those
    under the persistence threshold (100,000 elements by default: here all of them), which the step
    releases at its start and gathers again at its end: the trace must see those storages die and
    the new ones live on (memplan.estimator.swapped_storages).

    ZeRO-3 not in bf16 here: the real bf16 run peaks inside a CPU matmul (LinearFunctionForZeroStage3's
    backward), whose kernel takes 91,904 B of scratch from the CPU allocator that no dispatch mode
    sees (the profiler's events, `aten::mm`); memplan's cpu target does not model CPU BLAS scratch,
    and on CUDA that op's scratch is cuBLAS's workspace, which the cuda target does (so no amp-bf16 case of
    ZeRO-3 either). Under CPU autocast in float16 the stack's layer norms take a float16 input with float32
    weights, whose means and deviations the CPU keeps in float32 (memplan.estimator.oprules.norms): 192 B
    of the ZeRO-3 amp-fp16 case."""
    stage = STAGES[parallel]
    measured = _measured(name, world_size, precision, SMALL_BUCKET, stage=stage)
    predicted = _predicted(name, world_size, precision, SMALL_BUCKET, parallel=parallel)
    assert abs(predicted.peak_bytes - measured) <= 32, (predicted.peak_bytes, measured)


@pytest.mark.parametrize(("parallel", "world_size"), [("zero2", 2), ("zero3", 2), ("zero3", 4)])
def test_a_checkpointed_deepspeed_rank_is_the_real_deepspeed_run(parallel, world_size):
    """Every block checkpointed (non-reentrant, tests/hand_measure.checkpoint_each): ZeRO-3 gathers a
    block's parameters again for its recomputation in the backward. Within 64 bytes: the checkpoints'
    own scalars, which memplan's trace and the run count a few bytes apart."""

    def checkpointed() -> torch.nn.Module:
        model = fsdp_models.stack()
        checkpoint_each(model.blocks)
        return model

    config = deepspeed_models.deepspeed_config(STAGES[parallel], 16, "fp32", SMALL_BUCKET)
    measured = deepspeed_models.measured_peak(checkpointed, fsdp_models.rows, mean_square, world_size, config)
    predicted = _predicted("stack", world_size, zero=SMALL_BUCKET, parallel=parallel, checkpoint="all")
    assert abs(predicted.peak_bytes - measured) <= 64, (predicted.peak_bytes, measured)


@pytest.mark.parametrize(
    ("parallel", "name", "world_size", "precision", "grad_accum"),
    [
        ("zero2", "stack", 2, "fp32", 2),
        ("zero2", "stack-bf16", 4, "bf16", 2),
        ("zero2", "stack-fp16", 2, "fp16", 2),
        ("zero3", "stack", 2, "fp32", 3),
        ("zero1", "stack", 4, "fp32", 2),
    ],
)
def test_an_accumulating_deepspeed_rank_is_the_real_deepspeed_run(parallel, name, world_size, precision, grad_accum):
    """DeepSpeed's own accumulation (gradient_accumulation_steps): each micro-batch's gradients are
    reduced into the rank's partition, which lives across the step's micro-batches, and the
    optimizer runs after the last; the real loop calls engine.step() after every micro-batch. ZeRO-2
    adds the last micro-batch's gradients into those the earlier ones left and drops those at the
    end of its backward (memplan.distributed.deepspeed, dropped_in_step): counted to the step's end
    they put the fp32 peaks 211,336 B (2 ranks) and 9,672 B (4 ranks) above the run."""
    _, _, factory, make_batch, batch_size = MODELS[name]
    config = deepspeed_models.deepspeed_config(
        STAGES[parallel], batch_size, precision, SMALL_BUCKET, grad_accum=grad_accum
    )
    measured = deepspeed_models.measured_peak(factory, make_batch, mean_square, world_size, config)
    predicted = _predicted(name, world_size, precision, SMALL_BUCKET, parallel=parallel, grad_accum=grad_accum)
    assert abs(predicted.peak_bytes - measured) <= 32, (predicted.peak_bytes, measured)


@pytest.mark.parametrize(
    ("name", "world_size", "precision", "grad_accum"),
    [("stack", 2, "fp32", 3), ("stack-fp16", 2, "fp16", 2)],
)
def test_deepspeeds_stage_1_releases_its_reduce_bucket_at_the_accumulation_boundary(
    name, world_size, precision, grad_accum
):
    """DeepSpeed's stage 1 (--parallel zero1 with a --deepspeed file) makes its reduce bucket in the step's
    first backward and keeps it across the micro-batches to the boundary's epilogue, which releases it
    before the optimizer runs (memplan.distributed.deepspeed, dropped_in_step). Kept to the step's end, as
    a storage the traced micro-batch started with, it put these peaks 10,368 B and 39,978 B above the run."""
    _, _, factory, make_batch, batch_size = MODELS[name]
    config = deepspeed_models.deepspeed_config(1, batch_size, precision, SMALL_BUCKET, grad_accum=grad_accum)
    measured = deepspeed_models.measured_peak(factory, make_batch, mean_square, world_size, config)
    predicted = _predicted(name, world_size, precision, SMALL_BUCKET, parallel="zero1", grad_accum=grad_accum)
    assert abs(predicted.peak_bytes - measured) <= 32, (predicted.peak_bytes, measured)


def test_a_zero3_rank_gathering_each_module_is_the_real_deepspeed_run():
    """With no parameter persistent (threshold 0), each block's parameters are gathered for its
    forward and again for its backward, and released after each."""
    zero = {**SMALL_BUCKET, "stage3_param_persistence_threshold": 0}
    measured = _measured("stack", 2, "fp32", zero, stage=3)
    predicted = _predicted("stack", 2, "fp32", zero, parallel="zero3")
    assert abs(predicted.peak_bytes - measured) <= 32, (predicted.peak_bytes, measured)


def _unsharded(result):
    return [a for a in result.timeline.allocations if a.category == "unsharded_parameters"]


def test_zero3_gathers_each_parameter_when_its_module_runs_and_releases_persistent_ones_in_the_step():
    """DeepSpeed's rules for when a ZeRO-3 parameter is whole: with no parameter persistent, none is
    gathered as the iteration starts (every gathered storage is made in it, by a module's fetch); with
    all of them persistent, the ones the iteration starts with live until the step partitions them as
    it begins (stage3.py `step`: `_partition_all_parameters`), past their last reader in the backward,
    and new ones are gathered after it (`_post_step`) and kept to the end."""
    released = _predicted("stack", 2, "fp32", {**SMALL_BUCKET, "stage3_param_persistence_threshold": 0}, "zero3")
    assert _unsharded(released) and all(a.allocated_at > 0 for a in _unsharded(released))
    kept = _predicted("stack", 2, "fp32", SMALL_BUCKET, "zero3")
    timeline = kept.timeline
    at_start = [a for a in _unsharded(kept) if a.allocated_at == 0]
    after_step = [a for a in _unsharded(kept) if a.allocated_at >= timeline.backward_end]
    parameters = len(list(fsdp_models.stack().parameters()))
    assert len(at_start) == len(after_step) == parameters
    assert all(timeline.backward_end <= a.freed_at < timeline.node_count for a in at_start)
    assert all(a.freed_at == timeline.node_count for a in after_step)


def test_deepspeeds_default_bucket_is_two_gigabytes_whatever_the_model():
    """reduce_bucket_size's default, 5e8 elements, in the gradients' float32: the rank's peak is the
    bucket and a tiny model around it, as the real run shows."""
    predicted = _predicted("two-layer", 4)
    assert predicted.breakdown.communication == DEEPSPEED_DEFAULT_BUCKET * 4
    measured = _measured("two-layer", 4)
    assert abs(predicted.peak_bytes - measured) <= 32, (predicted.peak_bytes, measured)


def test_the_optimizer_state_is_one_nth_of_the_flattened_model():
    """DeepSpeed flattens the parameters, padded to a multiple of 2 × N elements
    (`nccl_start_alignment_factor` 2 × the data-parallel size, stage_1_and_2.py), and partitions them
    evenly: rank 0 keeps the whole flat model as parameters, and a float32 master copy and AdamW's two
    moments of 1/N of it (plus a 4-byte step) as optimizer state."""
    parameters = sum(p.numel() for p in fsdp_models.stack().parameters())
    for world_size in (2, 4):
        result = _predicted("stack", world_size, zero=SMALL_BUCKET)
        padded = -(-parameters // (2 * world_size)) * 2 * world_size
        assert result.breakdown.parameters == padded * 4
        assert result.breakdown.optimizer_state == 3 * (padded // world_size) * 4 + 4


def test_a_zero3_rank_keeps_one_nth_of_everything_and_gathers_what_persists():
    """ZeRO-3's rank keeps 1/N of the flattened model (rounded up) as its 16-bit partition, the same
    of gradients, and a float32 master copy and AdamW's two moments of it (plus a 4-byte step); every
    parameter of the stack is under the persistence threshold (100,000 elements by default), so at
    the peak all of them are gathered whole; and the parameter count is the model's, not the empty
    tensors ZeRO-3 leaves in the modules."""
    parameters = sum(p.numel() for p in fsdp_models.stack().parameters())
    assert max(p.numel() for p in fsdp_models.stack().parameters()) < 100_000
    for world_size in (2, 4):
        result = _predicted("stack", world_size, zero=SMALL_BUCKET, parallel="zero3")
        partition = -(-parameters // world_size) * 4
        assert result.breakdown.parameters == partition and result.breakdown.gradients == partition
        assert result.breakdown.optimizer_state == 3 * partition + 4
        assert result.breakdown.unsharded_parameters == -(-parameters // world_size) * world_size * 4
        assert result.breakdown.communication == SMALL_BUCKET["reduce_bucket_size"] * 4  # made once, kept
        assert result.parameter_count == parameters


def test_auto_bucket_sizes_are_filled_as_transformers_fills_them(tiny_model_dirs):
    """A Trainer's ds_config.json says "auto": transformers sets reduce_bucket_size to hidden_size²
    (the same estimate as that number given), and drops stage 3's settings for stage 2."""
    directory = Path(tiny_model_dirs["gpt2"])
    hidden = json.loads((directory / "config.json").read_text())["n_embd"]
    common = {"batch_size": 2, "seq_len": 32, "device": "cpu", "parallel": "zero2", "world_size": 2}
    auto = {
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
    }
    filled = {"zero_optimization": {"stage": 2, "reduce_bucket_size": hidden * hidden}}
    other = {"zero_optimization": {"stage": 2, "reduce_bucket_size": hidden * hidden * 64}}
    from_auto = memplan.estimate(str(directory), **common, deepspeed_config=auto)
    from_number = memplan.estimate(str(directory), **common, deepspeed_config=filled)
    assert from_auto.peak_bytes == from_number.peak_bytes
    assert from_auto.breakdown == from_number.breakdown
    # and the bucket size matters to this model's peak, so the equality says something
    assert memplan.estimate(str(directory), **common, deepspeed_config=other).peak_bytes != from_auto.peak_bytes


def test_compare_takes_the_file_to_the_other_stage_s_row():
    """From a ZeRO-2 base with a --deepspeed file, the ZeRO-3 row runs that file's settings with its own
    stage: the file's 20,000-element bucket, not DeepSpeed's default 500,000,000 (ZeRO-3 keeps it made
    once: 20,000 float32 elements at its peak); the rows of torch's strategies take no file. (The rows'
    settings from compare's own list, and the ZeRO-3 row estimated: the whole compare took 13-37 s.)"""
    from memplan.explore.compare import techniques
    from memplan.settings import TrainingSettings

    config = json.dumps({"zero_optimization": {"stage": 2, **SMALL_BUCKET}})
    base = TrainingSettings(batch_size=4, device="cpu", parallel="zero2", world_size=2, deepspeed_config=config)
    rows = [base.replace(**technique.changes) for technique in techniques(base) if "parallel" in technique.changes]
    stage3 = next(row for row in rows if row.parallel == "zero3")
    assert json.loads(stage3.deepspeed_config)["zero_optimization"] == SMALL_BUCKET
    others = [row for row in rows if row.parallel not in ("zero2", "zero3")]
    assert others and all(row.deepspeed_config is None for row in others)
    options = {"inputs": "tests.two_layer_mlp:rows", "loss": "tests.two_layer_mlp:mean_square"}
    result = memplan.estimate("tests.two_layer_mlp:two_layer", **options, **stage3.to_dict())
    assert result.breakdown.communication == SMALL_BUCKET["reduce_bucket_size"] * 4


@pytest.mark.parametrize(
    ("parallel", "precision"), [("zero1", "fp32"), ("zero2", "fp32"), ("zero3", "fp32"), ("zero2", "amp-fp16")]
)
def test_the_cpu_validator_measures_a_deepspeed_rank_as_the_allocator_does(parallel, precision):
    """`validate --device cpu` counts storages by dispatch (memplan.measure.cpu.measure_cpu); under
    ZeRO-3 the gathered parameters an iteration starts with are freed in it, so the counter counts what
    Python holds as it starts until it is freed. Its measurement against the allocator's own events
    for the same run (tests/deepspeed_models.py). In amp-fp16 the run steps through torch's GradScaler and
    the gradient-norm check, which the fake group's unwritten buckets would make skip the step (the
    optimizer state never made: the count 96,264 B off) where a healthy run's do not."""
    from memplan.measure.cpu import measure_cpu
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings

    spec = resolve_model(
        "tests.two_layer_mlp:two_layer", inputs="tests.two_layer_mlp:rows", loss="tests.two_layer_mlp:mean_square"
    )
    config = json.dumps({"zero_optimization": SMALL_BUCKET})
    settings = TrainingSettings(
        batch_size=4, device="cpu", parallel=parallel, world_size=2, deepspeed_config=config, precision=precision
    )
    counted = measure_cpu(spec, spec.settings_for(settings)).peak_bytes
    measured = _measured("two-layer", 2, precision, SMALL_BUCKET, stage=STAGES[parallel])
    assert abs(counted - measured) <= 32, (counted, measured)


def _mlp_command(parallel: str) -> list[str]:
    """`memplan estimate` of the two-layer MLP on the cpu target at batch 4, one rank of `parallel`."""
    args = ["estimate", "tests.two_layer_mlp:two_layer", "--inputs", "tests.two_layer_mlp:rows"]
    return [*args, "--loss", "tests.two_layer_mlp:mean_square", "-b", "4", "--device", "cpu", "--parallel", parallel]


def test_the_cli_names_a_zero3_rank():
    args = _mlp_command("zero3")
    result = CliRunner().invoke(main, [*args, "--world-size", "2"])
    assert result.exit_code == 0, result.output
    assert "one DeepSpeed ZeRO-3 rank of 2" in result.output


def test_zero1_is_deepspeeds_stage_1_with_a_deepspeed_file_and_torchs_without(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1, **SMALL_BUCKET}}))
    args = _mlp_command("zero1")
    deepspeeds = CliRunner().invoke(main, [*args, "--world-size", "2", "--deepspeed", str(config)])
    assert deepspeeds.exit_code == 0, deepspeeds.output
    assert "one DeepSpeed ZeRO-1 rank of 2" in deepspeeds.output and "ZeroRedundancyOptimizer" not in deepspeeds.output
    torchs = CliRunner().invoke(main, [*args, "--world-size", "2"])
    assert torchs.exit_code == 0, torchs.output
    assert "ZeRO-1 (DDP, optimizer state sharded)" in torchs.output


def test_the_cli_reads_the_config_and_names_the_rank(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, **SMALL_BUCKET}}))
    args = _mlp_command("zero2")
    result = CliRunner().invoke(main, [*args, "--world-size", "4", "--deepspeed", str(config)])
    assert result.exit_code == 0, result.output
    assert "one DeepSpeed ZeRO-2 rank of 4" in result.output and "DeepSpeed reduce buckets" in result.output
    # the file's bucket, 20,000 float32 elements, at the peak in the backward
    as_json = CliRunner().invoke(main, [*args, "--world-size", "4", "--deepspeed", str(config), "--json"]).stdout
    assert json.loads(as_json)["phase"] == "backward"
    assert json.loads(as_json)["breakdown"]["communication"] == 20_000 * 4


OFFLOAD_CASES = [  # --parallel, model, ranks, micro-batches per step, --offload, ZeRO-3's persistence threshold
    ("zero1", "stack", 2, 3, "optimizer", None),
    ("zero2", "two-layer", 8, 1, "optimizer", None),
    ("zero3", "stack", 4, 2, "optimizer", None),
    ("zero3", "stack", 2, 2, "params", 0),  # offload_param too, each block gathered from its host partition
]


def offloading_rank(
    parallel: str,
    name: str,
    world_size: int,
    grad_accum: int,
    offload: str,
    persistence: int | None = None,
    precision: str = "fp32",
) -> tuple[memplan.EstimateResult, tuple[int, int]]:
    """memplan's estimate of an offloading DeepSpeed rank, and the real run's device and host peaks
    (tests/deepspeed_models.measured_offload_peaks); benchmarks/distributed_real_runs.py prints more cases."""
    reference, inputs, factory, make_batch, batch_size = MODELS[name]
    zero = dict(SMALL_BUCKET)
    if persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    # The real run's optimizer is torch's AdamW, which DeepSpeed runs on the host when told it may.
    config = {"zero_optimization": zero, "zero_force_ds_cpu_optimizer": False}
    options = {"optimizer": "adamw", "parallel": parallel, "world_size": world_size, "grad_accum": grad_accum}
    source = {"inputs": inputs, "loss": "tests.two_layer_mlp:mean_square", "batch_size": batch_size}
    predicted = memplan.estimate(
        reference, **source, device="cpu", precision=precision, **options, offload=offload, deepspeed_config=config
    )
    zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "params":
        zero["offload_param"] = {"device": "cpu"}
    config = deepspeed_models.deepspeed_config(STAGES[parallel], batch_size, precision, zero, grad_accum)
    return predicted, deepspeed_models.measured_offload_peaks(factory, make_batch, mean_square, world_size, config)


@pytest.mark.parametrize(("parallel", "name", "world_size", "grad_accum", "offload", "persistence"), OFFLOAD_CASES)
def test_an_offloading_deepspeed_rank_is_the_real_run_on_the_gpu_and_the_host(
    parallel, name, world_size, grad_accum, offload, persistence
):
    """--offload optimizer (DeepSpeed's offload_optimizer) and, on ZeRO-3, --offload params (offload_param
    with it) against DeepSpeed's real run, whose allocator events are told apart by
    tests/deepspeed_models.measured_offload_peaks (the host's: what the optimizer's step and the host's
    gradient norm allocate, and the host buffers DeepSpeed keeps, the parameters' partitions among them)."""
    predicted, (device, host) = offloading_rank(parallel, name, world_size, grad_accum, offload, persistence)
    assert abs(predicted.peak_bytes - device) <= 8, (predicted.peak_bytes, device)
    # The step's Python numbers that torch wraps as 0-d tensors (AdamW's step counts), which no trace sees.
    assert abs(predicted.host_peak_bytes - host) <= 64, (predicted.host_peak_bytes, host)
    assert predicted.breakdown.optimizer_state == 0  # the master partition and the optimizer's state: the host's
    if offload == "params":  # and the parameters' partitions
        assert predicted.breakdown.parameters == 0


def test_an_offloading_rank_s_host_memory_worked_by_hand():
    """The two-layer MLP on 8 ranks under ZeRO-2 with offload_optimizer. DeepSpeed requires DeepSpeedCPUAdam
    there (accelerate turns the Trainer's optimizer into it): two float32 moments per partition and a step
    that makes no temporaries, so the host holds, at every moment, the partition (24,064 / 8 = 3,008 float32
    elements, 12,032 B), its gradient, the staging partition and the two moments, and the one-parameter
    gradient buffer (64 x 256 float32, 65,536 B). On a GPU DeepSpeed pins the first three (stage_1_and_2.py,
    pin_memory: true) and torch's CachingHostAllocator rounds each up to a power of two
    (CachingHostAllocator.h, PowerOf2Ceil): 16,384 B each; the buffer is a power of two already. torch's
    AdamW run there instead (`zero_force_ds_cpu_optimizer: false`) makes its for-loop's temporaries on top."""
    options = {"optimizer": "adamw", "parallel": "zero2", "world_size": 8, "offload": "optimizer"}
    source = {"inputs": "tests.two_layer_mlp:rows", "loss": "tests.two_layer_mlp:mean_square", "batch_size": 4}
    cpu_adam = _mlp(**options)
    on_a_gpu = memplan.estimate("tests.two_layer_mlp:two_layer", **source, **options)
    torch_adamw = _mlp(**options, deepspeed_config={"zero_force_ds_cpu_optimizer": False})
    partition_bytes = 24_064 // 8 * 4
    # (4 B: the gradient norm the step keeps, a 0-d float32 tensor on the host)
    assert abs(cpu_adam.host_peak_bytes - (5 * partition_bytes + 65_536)) <= 4, cpu_adam.host_peak_bytes
    assert on_a_gpu.host_peak_bytes - cpu_adam.host_peak_bytes == 3 * (16_384 - partition_bytes)
    assert torch_adamw.host_peak_bytes > cpu_adam.host_peak_bytes + partition_bytes  # at least one temporary
    assert torch_adamw.peak_bytes == cpu_adam.peak_bytes  # the GPU's share does not depend on it
    note = next(note for note in cpu_adam.notes if "offload_optimizer" in note)
    assert "DeepSpeedCPUAdam" in note and "optimizer='adamw'" in note


def _mlp(model: str = "tests.two_layer_mlp:two_layer", **settings):
    """The two-layer MLP (or `model` on its rows) estimated on the cpu target at batch 4."""
    source = {"inputs": "tests.two_layer_mlp:rows", "loss": "tests.two_layer_mlp:mean_square"}
    return memplan.estimate(model, **source, batch_size=4, device="cpu", **settings)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loop": "hf-trainer"}, "parallel='zero2' with loop"),
        (
            {"deepspeed_config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}},
            'zero_optimization.offload_optimizer moves the optimizer state to "nvme" (ZeRO-Infinity)',
        ),
        (
            {"deepspeed_config": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}}},
            "offloads part of the optimizer (ratio below 1",
        ),
        ({"offload": "params"}, "DeepSpeed offloads parameters at stage 3 (offload_param): give parallel='zero3'"),
        (
            {"deepspeed_config": {"zero_optimization": {"offload_param": {"device": "cpu"}}}},
            "offload_param is ZeRO-3's: give parallel='zero3'",
        ),
        ({"optimizer": "none"}, "optimizer='none' has none"),
        (
            {
                "precision": "amp-bf16",
                "deepspeed_config": {
                    "zero_optimization": {"stage": 2},
                    "torch_autocast": {
                        "enabled": True,
                        "dtype": "bfloat16",
                        "lower_precision_safe_modules": ["nope.Nothing"],
                    },
                },
            },
            "torch_autocast.lower_precision_safe_modules: Failed to import lower precision safe module nope.Nothing",
        ),
        (
            {"deepspeed_config": {"zero_optimization": {"stage": 3}}},
            "sets ZeRO stage 3; parallel='zero2' traces stage 2: give parallel='zero3'",
        ),
        (
            {"deepspeed_config": {"zero_optimization": {"stage": 1}}},
            "sets ZeRO stage 1; parallel='zero2' traces stage 2: give parallel='zero1'",
        ),
        (
            {"deepspeed_config": {"zero_optimization": {"stage": 0}}},
            "stage 0; parallel='zero2' traces stage 2: memplan traces stages 1 to 3",
        ),
        ({"deepspeed_config": {"zero_optimization": {"overlap_comm": "auto"}}}, 'overlap_comm is "auto"'),
        ({"deepspeed_config": "[1, 2]"}, "the DeepSpeed configuration holds a JSON list, not an object"),
        (  # DeepSpeed's own check of its sections (pydantic), in one line
            {"deepspeed_config": {"zero_optimization": {"reduce_bucket_size": -5}}},
            "DeepSpeedZeroConfig refuses reduce_bucket_size: Input should be greater than 0 (given -5)",
        ),
    ],
)
def test_zero2_mistakes_are_one_line(options, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        _mlp(**{"optimizer": "adamw", "parallel": "zero2", "world_size": 2, **options})


def test_a_deepspeed_config_without_zero2_is_refused():
    with pytest.raises(SettingsError, match="give parallel='zero1', zero2 or zero3 with it"):
        _mlp(deepspeed_config={"zero_optimization": {"stage": 2}})


def test_the_rank_s_group_gives_way_to_the_next_estimate():
    """A ZeRO-2 rank keeps its fake group while it lives; an FSDP2 estimate of another world size
    after it gets a group of its own, and the process is left without one."""
    _estimate("two-layer", 4, zero=SMALL_BUCKET)
    memplan.estimate(
        "tests.fsdp_models:stack",
        inputs="tests.fsdp_models:rows",
        loss="tests.fsdp_models:mean_square",
        batch_size=4,
        device="cpu",
        parallel="fsdp",
        world_size=2,
    )
    assert not dist.is_initialized()


def test_without_deepspeed_installed_it_is_one_line(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_deepspeed(name, *args, **kwargs):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ImportError("No module named 'deepspeed'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_deepspeed)
    with pytest.raises(SettingsError, match=r"pip install deepspeed"):
        _estimate("two-layer", 2, zero=SMALL_BUCKET)


def test_the_process_is_left_as_it_was():
    """No fake group, launcher variables or DeepSpeed accelerator of memplan's outlive the estimate
    (a later Trainer or DeepSpeed run in the same process must not find them)."""
    import os

    from deepspeed.accelerator import real_accelerator

    before = (
        {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        real_accelerator.ds_accelerator,
    )
    _estimate("two-layer", 4, zero=SMALL_BUCKET)
    after = (
        {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        real_accelerator.ds_accelerator,
    )
    assert after[0] == before[0] and after[1] is before[1]
    assert not dist.is_initialized()


def test_zero3_leaves_torch_s_own_linear_in_place():
    """DeepSpeed's stage 3 puts its own linear in torch.nn.functional for the rest of the process
    (partition_parameters.py, _enable_mem_efficient_linear); the rank's model runs with it (its
    backward is what the real run's is), and memplan's process gets torch's back."""
    import torch

    linear = torch._C._nn.linear  # torch's own, which torch.nn.functional.linear is
    assert torch.nn.functional.linear is linear
    seen = []
    from tests import fsdp_models as models

    original = models.Stack.forward

    def forward(self, x):
        seen.append(torch.nn.functional.linear)
        return original(self, x)

    models.Stack.forward = forward
    try:
        _estimate("stack", 2, zero=SMALL_BUCKET, parallel="zero3")
    finally:
        models.Stack.forward = original
    assert torch.nn.functional.linear is linear
    assert seen and all(function is not linear for function in seen)


def test_the_step_s_peak_is_in_no_module_after_checkpointed_blocks():
    """Checkpointed blocks' recomputation stops early, so the last one recomputed never runs its
    forward hook; the step's peak must still be named as in no module (it was `blocks.0.down`)."""
    result = _predicted("stack", 2, zero=SMALL_BUCKET, checkpoint="all")
    assert result.phase == "optimizer" and result.peak_module is None


def test_a_process_with_its_own_group_is_told_to_estimate_elsewhere():
    """memplan never touches a job's real group: a process that initialized torch.distributed gets one line."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(SettingsError, match="initialized torch.distributed already"):
            _estimate("two-layer", 2, zero=SMALL_BUCKET)
        assert dist.is_initialized() and dist.get_backend() == "gloo"  # left as it was
    finally:
        dist.destroy_process_group()


def test_the_step_finds_the_gradient_partition_buffer_as_gradients():
    """At the step, the rank's reduced gradients are in the buffer DeepSpeed keeps for its partition,
    which holds each parameter the partition overlaps, whole (stage_1_and_2.py, grads_in_partition):
    rank 0's first 12,032 of the 24,064 flat elements lie in the first weight, 16,384 elements."""
    result = _predicted("two-layer", 2, zero=SMALL_BUCKET)
    assert result.phase == "optimizer"
    assert result.breakdown.gradients == 256 * 64 * 4


def test_a_model_with_nothing_to_train_is_one_line():
    from torch import nn

    from memplan.distributed.deepspeed import DeepSpeedRank

    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(SettingsError, match="--parallel zero3: the model has no trainable parameter"):
        DeepSpeedRank(frozen, None, 2, {"zero_optimization": {"stage": 3}})  # type: ignore[arg-type]


def test_deepspeeds_log_goes_to_stderr_and_stdout_keeps_the_json():
    """DeepSpeed logs to stdout from its import on (the accelerator it detects, its configuration): in a
    fresh process, where memplan imports it, stdout holds nothing but the JSON, and what DeepSpeed logs
    later in the process (its errors) reaches stderr, not a swallowed buffer."""
    import subprocess
    import sys

    args = ["estimate", "tests.two_layer_mlp:two_layer", "--inputs", "tests.two_layer_mlp:rows", "--loss"]
    args += ["tests.two_layer_mlp:mean_square", "-b", "4", "--device", "cpu", "--parallel", "zero2"]
    args += ["--world-size", "2", "--json"]
    script = (
        "import sys\n"
        "from memplan.cli import main\n"
        f"main({args!r}, standalone_mode=False)\n"
        "from deepspeed.utils.logging import logger\n"
        "streams = [handler.stream is sys.stderr for handler in logger.handlers]\n"
        "print('handlers', all(streams), len(streams), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["settings"]["parallel"] == "zero2"
    assert "[WARNING]" not in done.stderr and "[INFO]" not in done.stderr
    assert done.stderr.split()[-3:] == ["handlers", "True", "1"], done.stderr


def test_a_forward_that_branches_on_a_value_is_refused_not_guessed():
    """memplan answers DeepSpeed's own value checks (its overflow test) without values, never the
    model's: a forward that branches on a tensor's value is a one-line trace error, as without DeepSpeed."""
    from memplan.errors import TraceError

    with pytest.raises(TraceError, match="depends on tensor values"):
        _mlp(
            "tests.deepspeed_models:branching",
            parallel="zero2",
            world_size=2,
            deepspeed_config={"zero_optimization": SMALL_BUCKET},
        )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "holds a JSON list"),
        # DeepSpeed's own assert, as it builds the engine: it had been "internal error: AssertionError"
        (
            '{"zero_optimization": {"stage": 2}, "prescale_gradients": true}',
            "DeepSpeed refuses it: pre-scale gradients is not yet supported with ZeRO-2",
        ),
    ],
)
def test_a_deepspeed_file_that_is_not_a_configuration_is_a_usage_error(tmp_path, content, message):
    config = tmp_path / "ds_config.json"
    config.write_text(content)
    args = ["estimate", "tests.two_layer_mlp:two_layer", "--inputs", "tests.two_layer_mlp:rows", "-b", "4"]
    result = CliRunner().invoke(main, [*args, "--device", "cpu", "--parallel", "zero2", "--deepspeed", str(config)])
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output and config.read_text() == content  # the user's file untouched


def test_compare_offers_deepspeed_s_offload_on_a_deepspeed_rank_and_keeps_each_row_valid():
    """What compare offers (its rows run elsewhere): DeepSpeed's offload_optimizer beside a ZeRO rank that keeps
    its optimizer on the GPU; from an offloading rank, the other ZeRO stage offloads too and the rest do not
    (FSDP2 and torch's ZeRO-1 take no --offload optimizer)."""
    from memplan.explore.compare import techniques
    from memplan.settings import TrainingSettings

    on_zero2 = {t.name: t.changes for t in techniques(TrainingSettings(parallel="zero2", world_size=4))}
    assert on_zero2["DeepSpeed offload_optimizer (optimizer in host memory)"] == {"offload": "optimizer"}
    offloading = TrainingSettings(parallel="zero2", world_size=4, offload="optimizer")
    rows = {t.name: t.changes for t in techniques(offloading)}
    assert "DeepSpeed offload_optimizer (optimizer in host memory)" not in rows
    assert "offload" not in rows["DeepSpeed ZeRO-3 (parameters partitioned too)"]
    assert rows["FSDP2 (reshard after forward)"]["offload"] == "none"
    for changes in rows.values():  # the rows that change the sharding are valid settings (compare skips others)
        if "parallel" in changes:
            TrainingSettings(**{"parallel": "zero2", "world_size": 4, "offload": "optimizer", **changes})
    in_the_file = TrainingSettings(
        parallel="zero3",
        world_size=4,
        deepspeed_config='{"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}',
    )
    assert in_the_file.offloads_to_host
    from_the_file = {t.name: t.changes for t in techniques(in_the_file)}
    assert not any(changes.get("offload") == "optimizer" for changes in from_the_file.values())
    # ZeRO-3 also offers offload_param (--offload params: the parameters' partitions with the optimizer)
    both = "DeepSpeed offload_param + offload_optimizer (parameters and optimizer in host memory)"
    assert from_the_file[both] == {"offload": "params"}
    assert both not in {t.name for t in techniques(TrainingSettings(parallel="zero3", world_size=4, offload="params"))}


def test_the_validator_counts_no_tensor_of_peft_s_import_as_a_lora_rank_s(tmp_path):
    """A DeepSpeed rank's count takes every tensor Python holds at the iteration's start that it did not hold as the
    measurement began; peft's import, and bitsandbytes' through it, made module-level tensors after that point (its
    4-bit tables, default arguments): a LoRA rank measured 144 B over its prediction in every stage (a helper's bug
    hunt); under peft 0.22, which imports bitsandbytes only as it wraps the model, 128 B over (CI, 2026-12-07).
    Run by `validate`, whose measurement is a fresh process."""
    from click.testing import CliRunner

    from memplan.cli import main

    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": SMALL_BUCKET}))
    args = ["validate", "tests.two_layer_mlp:two_layer", "--inputs", "tests.two_layer_mlp:rows"]
    args += ["--loss", "tests.two_layer_mlp:mean_square", "-b", "4", "--device", "cpu", "--parallel", "zero2"]
    args += ["--world-size", "2", "--lora", "2", "--lora-targets", "up", "--deepspeed", str(tmp_path / "ds.json")]
    done = CliRunner().invoke(main, [*args, "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    assert abs(result["predicted_peak_bytes"] - result["measured_peak_bytes"]) <= 32, result
