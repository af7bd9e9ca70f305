"""`--parallel ddp` (memplan.distributed.ddp): one DistributedDataParallel rank, traced.

Truth: the same step run for real on the CPU with torch's DDP over a real gloo process group
(tests/ddp_models.py, built without memplan), its buckets read from the comm hook DDP hands them
to. Per rank, DDP's memory does not depend on the world size (its collectives work in place), so a
prediction for 4 ranks is checked against the one real rank this machine can run."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from click.testing import CliRunner

import memplan
from memplan.cli import main
from memplan.distributed.ddp import DataParallelRank
from memplan.errors import SettingsError
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests import ddp_models

SOURCE = {"inputs": "tests.ddp_models:rows", "loss": "tests.ddp_models:mean_square"}


@pytest.fixture
def gloo_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _storage_bytes(tensors) -> int:
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def test_a_batch_norm_rank_of_two_rows_accumulating_is_the_real_ddp_run(gloo_group):
    """The per-sample slope is traced at one row, where BatchNorm refuses to train; the estimate then traces twice
    the batch instead (BatchTracer.slope_batch_size), but a DDP rank's untraced micro-batch (the gradients of the
    ones before) raised its ValueError unwrapped: an internal error, and compare's "grad accumulation ×4" row
    broke the whole compare."""
    options = {"batch_size": 2, "grad_accum": 4, "device": "cpu"}
    predicted = memplan.estimate("tests.ddp_models:stack", **SOURCE, parallel="ddp", world_size=2, **options)
    spec = resolve_model("tests.ddp_models:ddp_stack", **SOURCE)
    measured = measure_cpu(spec, spec.settings_for(TrainingSettings(**options)), warmup_iterations=2)
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 8, (predicted.peak_bytes, measured.peak_bytes)


@pytest.mark.parametrize(
    ("checkpoint", "optimizer", "grad_accum"), [("none", "adamw", 1), ("all", "sgd", 1), ("none", "adamw", 2)]
)
def test_a_ddp_rank_is_the_real_ddp_run(gloo_group, checkpoint, optimizer, grad_accum):
    options = {"batch_size": 16, "device": "cpu", "checkpoint": checkpoint, "optimizer": optimizer}
    options["grad_accum"] = grad_accum
    predicted = memplan.estimate("tests.ddp_models:stack", **SOURCE, parallel="ddp", world_size=4, **options)
    spec = resolve_model("tests.ddp_models:ddp_stack", **SOURCE)
    # Two warm-up iterations: the second's forward makes the buckets again (_rebuild_buckets).
    measured = measure_cpu(spec, spec.settings_for(TrainingSettings(**options)), warmup_iterations=2)
    buckets = _storage_bytes(ddp_models.BUCKETS.values())
    trainable = sum(p.numel() * p.element_size() for p in ddp_models.Stack().parameters())
    assert buckets == trainable  # every gradient once more (gradient_as_bucket_view=False)
    assert predicted.breakdown.communication == buckets
    # The real run's counter takes the buckets as live from the start (they existed before it), as memplan does.
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 8, (predicted.peak_bytes, measured.peak_bytes)


@pytest.mark.parametrize(
    ("checkpoint", "optimizer", "grad_accum"), [("none", "adamw", 1), ("all", "sgd", 1), ("none", "adamw", 2)]
)
def test_with_gradients_as_bucket_views_a_ddp_rank_is_the_real_ddp_run(gloo_group, checkpoint, optimizer, grad_accum):
    """gradient_as_bucket_view=True: the gradients are views into the buckets, one copy, not two;
    the last micro-batch of an accumulating step finds them there, as DDP left them."""
    options = {"batch_size": 16, "device": "cpu", "checkpoint": checkpoint, "optimizer": optimizer}
    options["grad_accum"] = grad_accum
    ddp = {"parallel": "ddp", "world_size": 4}
    viewed = memplan.estimate("tests.ddp_models:stack", **SOURCE, **ddp, ddp_bucket_view=True, **options)
    copied = memplan.estimate("tests.ddp_models:stack", **SOURCE, **ddp, **options)
    spec = resolve_model("tests.ddp_models:ddp_stack_bucket_view", **SOURCE)
    measured = measure_cpu(spec, spec.settings_for(TrainingSettings(**options)), warmup_iterations=2)
    assert abs(viewed.peak_bytes - measured.peak_bytes) <= 8, (viewed.peak_bytes, measured.peak_bytes)
    trainable = sum(p.numel() * p.element_size() for p in ddp_models.Stack().parameters())
    assert 0 < copied.peak_bytes - viewed.peak_bytes <= trainable  # at most the second copy of every gradient
    assert viewed.breakdown.gradients == trainable and viewed.breakdown.communication == 0  # the buckets are them


def test_a_transformers_model_in_bf16_has_bf16_buckets_for_its_trainable_parameters(tiny_model_dirs):
    """transformers models are called with keyword arguments, which DDP passes on; their buckets
    take the gradients' dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tiny_model_dirs["gpt2"]
    result = memplan.estimate(
        folder, batch_size=2, seq_len=16, device="cpu", precision="bf16", parallel="ddp", world_size=2
    )
    real = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    distinct = {id(p): p for p in real.parameters()}  # the tied LM head is the embedding
    assert result.breakdown.communication == 2 * sum(p.numel() for p in distinct.values())


def test_ddp_adds_the_buckets_and_leaves_the_rest_of_the_step_as_it_was():
    plain = memplan.estimate("tests.ddp_models:stack", **SOURCE, batch_size=16, device="cpu")
    ranked = memplan.estimate(
        "tests.ddp_models:stack", **SOURCE, batch_size=16, device="cpu", parallel="ddp", world_size=8
    )
    assert ranked.breakdown.communication > 0 and plain.breakdown.communication == 0
    assert ranked.breakdown.parameters == plain.breakdown.parameters
    assert ranked.breakdown.optimizer_state == plain.breakdown.optimizer_state
    assert not dist.is_initialized()  # the fake group is never the default group


def test_the_total_batch_is_printed():
    result = CliRunner().invoke(
        main,
        [
            "estimate",
            "tests.ddp_models:stack",
            "--inputs",
            SOURCE["inputs"],
            "--loss",
            SOURCE["loss"],
            "--device",
            "cpu",
            "-b",
            "16",
            "--grad-accum",
            "2",
            "--parallel",
            "ddp",
            "--world-size",
            "8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "one DDP rank of 8 (total batch 16×2×8 = 256)" in result.output
    assert "DDP gradient buckets" in result.output


def test_a_parameter_the_loss_never_reaches_is_one_line_as_ddp_refuses_it():
    source = ["--inputs", SOURCE["inputs"], "--loss", SOURCE["loss"], "--device", "cpu", "-b", "4"]
    arguments = ["estimate", "tests.ddp_models:with_unused", *source, "--parallel", "ddp", "--world-size", "2"]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 1
    assert "get no gradient in the step" in result.output and "find_unused_parameters" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert memplan.estimate(
        "tests.ddp_models:with_unused", **SOURCE, batch_size=4, device="cpu"
    ).peak_bytes  # no DDP: fine


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"world_size": 4}, "--world-size 4 counts data-parallel ranks: give --parallel ddp"),
        ({"parallel": "ddp", "world_size": 0}, "world size must be a positive integer"),
        (
            {"parallel": "zero4", "world_size": 2},
            "parallel mode must be one of none, ddp, zero1, fsdp, fsdp-grad-op, hsdp, zero2, zero3",
        ),
        ({"ddp_bucket_view": True}, "--ddp-bucket-view is an option of DDP: give --parallel ddp or zero1"),
    ],
)
def test_parallel_mistakes_are_settings_errors(options, message):
    with pytest.raises(SettingsError, match=message):
        TrainingSettings(**options)


@pytest.mark.parametrize("step", ["two_views", "accumulate_halves"])
def test_a_custom_step_on_a_ddp_rank_is_its_real_run(step):
    """The user's own step gets the DDP-wrapped model; the real run is DDP's own, on real tensors, over
    the same fake group (its collectives move nothing; memory is DDP's)."""
    spec = resolve_model("tiny-gpt2")
    options = {"batch_size": 4, "seq_len": 32, "device": "cpu", "step": f"tests.custom_steps:{step}"}
    settings = spec.settings_for(TrainingSettings(**options, parallel="ddp", world_size=2))
    predicted = memplan.estimate("tiny-gpt2", **options, parallel="ddp", world_size=2)
    measured = measure_cpu(spec, settings, warmup_iterations=2)
    assert predicted.breakdown.communication > 0
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 8, (predicted.peak_bytes, measured.peak_bytes)


def test_compare_counts_the_ranks_in_the_effective_batch():
    common = ["--inputs", SOURCE["inputs"], "--loss", SOURCE["loss"], "--device", "cpu", "-b", "16"]
    command = ["compare", "tests.ddp_models:stack", *common, "--parallel", "ddp", "--world-size", "8", "--json"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert {row["effective_batch_size"] for row in rows if row["settings"]["grad_accum"] == 1} == {16 * 8}
    # its float32 batch cannot go into bfloat16 weights, as the real step could not: the row is skipped, said why
    (skipped,) = json.loads(result.stdout)["skipped"]
    assert skipped.startswith("pure bf16:") and "needs operands of one dtype" in skipped
    sharding_rows = ("FSDP2", "ZeRO-1", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3")
    assert all(row["settings"]["parallel"] == "ddp" for row in rows if not row["name"].startswith(sharding_rows))
    assert all(row["settings"]["world_size"] == 8 for row in rows)
    bucket_view = next(row for row in rows if row["name"] == "DDP gradient_as_bucket_view")
    as_given = next(row for row in rows if row["name"] == "as given")
    assert bucket_view["peak_bytes"] < as_given["peak_bytes"] and bucket_view["settings"]["ddp_bucket_view"]
    sharded = next(row for row in rows if row["name"] == "FSDP2 (reshard after forward)")
    assert sharded["settings"]["parallel"] == "fsdp"  # the same 8 ranks, each keeping an eighth of the state
    assert 8 * sharded["breakdown"]["optimizer_state"] <= as_given["breakdown"]["optimizer_state"] + 8 * 4096
    zero = next(row for row in rows if row["name"] == "ZeRO-1 (optimizer state sharded)")
    assert zero["settings"]["parallel"] == "zero1" and zero["peak_bytes"] < as_given["peak_bytes"]
    deepspeed = next(row for row in rows if row["name"].startswith("DeepSpeed ZeRO-2"))
    assert deepspeed["settings"]["parallel"] == "zero2"
    assert deepspeed["breakdown"]["communication"] == 500_000_000 * 4  # DeepSpeed's default bucket, float32
    stage3 = next(row for row in rows if row["name"].startswith("DeepSpeed ZeRO-3"))
    assert stage3["settings"]["parallel"] == "zero3"
    # ZeRO-3's bucket is made once and kept: the same 2 GB at its peak; its parameters are sharded too
    assert stage3["breakdown"]["communication"] == 500_000_000 * 4
    assert stage3["breakdown"]["parameters"] < as_given["breakdown"]["parameters"] / 4
    clash = CliRunner().invoke(main, [*command[:-1], "--gpus", "4"])
    assert clash.exit_code == 2 and "--gpus 4 and --world-size 8" in clash.output


def test_a_model_with_nothing_to_train_is_one_line():
    from torch import nn

    with pytest.raises(SettingsError, match="no trainable parameter"):
        DataParallelRank(nn.Linear(4, 4).requires_grad_(False), 2)


def test_memplan_s_own_quantization_buffers_are_not_broadcast(tiny_model_dirs):
    """bitsandbytes keeps a quantized layer's constants as attributes, which real DDP never
    broadcasts; memplan keeps them as buffers (to count them), and tells DDP to leave them out."""
    from memplan.estimator.trace import build_fake_setup
    from memplan.finetune.quantize import bookkeeping_buffers

    spec = resolve_model(tiny_model_dirs["llama"])
    options = {"batch_size": 1, "seq_len": 8, "device": "cpu", "lora_rank": 4, "quantize": "nf4"}
    settings = spec.settings_for(TrainingSettings(**options, parallel="ddp", world_size=2))
    state = build_fake_setup(spec, settings).state
    wrapper = state.data_parallel.wrapper
    names = bookkeeping_buffers(state.built_model)
    layers = sum(
        1
        for module in state.built_model.modules()
        if type(module).__name__ == "Linear4bit" and hasattr(module, "quant_state_code")
    )
    assert len(names) == 5 * layers > 0  # absmax, code, offset, absmax2, code2 per 4-bit layer
    assert set(wrapper.parameters_to_ignore) == set(names)
    broadcast = {id(buffer) for buffer in wrapper.modules_buffers}
    assert not broadcast & {id(buffer) for name, buffer in state.built_model.named_buffers() if name in names}


@pytest.mark.parametrize(
    ("name", "world_size", "checkpoint", "precision"),
    [
        ("gpt2", 2, "none", "fp32"),
        ("llama", 4, "all", "amp-bf16"),
        ("bert", 8, "none", "fp32"),
        ("distilbert", 2, "all", "fp32"),
        ("vit", 8, "all", "fp32"),
        ("resnet", 4, "none", "fp32"),
    ],
)
def test_a_ddp_rank_of_each_architecture_is_its_real_run(tiny_model_dirs, name, world_size, checkpoint, precision):
    """`validate --parallel ddp --device cpu` measures this: rank 0's step run for real on CPU tensors
    under the same fake group (its collectives move nothing; the memory is DDP's own)."""
    spec = resolve_model(tiny_model_dirs[name])
    options = {"batch_size": 2, "device": "cpu", "checkpoint": checkpoint, "precision": precision}
    settings = spec.settings_for(TrainingSettings(**options, parallel="ddp", world_size=world_size))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    measured = measure_cpu(spec, settings, warmup_iterations=2).peak_bytes
    assert abs(predicted - measured) <= 8, (predicted, measured)  # the 0-d loss: 4 B, as in the zoo
