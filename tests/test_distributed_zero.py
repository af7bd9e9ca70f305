"""`--parallel zero1` (memplan.distributed.zero): one DDP rank with torch's ZeroRedundancyOptimizer, traced.

Truth: the same step run for real on CPU tensors, DDP and ZeroRedundancyOptimizer over torch's fake
process group of N ranks (its collectives move nothing; the memory is their own), measured by the
CPU allocator's own allocation and free events (tests/zero_models.py, built without memplan); and
rank 0's share of the parameters worked out here from the partition rule torch documents."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import memplan
from memplan.cli import main
from memplan.errors import SettingsError
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests import zero_models
from tests.ddp_models import Stack

SOURCE = {"inputs": "tests.ddp_models:rows", "loss": "tests.ddp_models:mean_square"}


def _estimate(**options):
    return memplan.estimate("tests.ddp_models:stack", **SOURCE, batch_size=16, device="cpu", **options)


@pytest.mark.parametrize(
    ("world_size", "optimizer", "checkpoint", "grad_accum"),
    [(2, "adamw", "none", 1), (8, "sgd-momentum", "all", 1), (3, "adamw", "all", 2)],
)
def test_a_zero1_rank_is_the_real_run(world_size, optimizer, checkpoint, grad_accum):
    predicted = _estimate(
        parallel="zero1", world_size=world_size, optimizer=optimizer, checkpoint=checkpoint, grad_accum=grad_accum
    )
    measured = zero_models.measured_peak(
        world_size, 16, "adamw" if optimizer == "adamw" else "sgd", checkpoint == "all", grad_accum
    )
    # Plain DDP with AdamW, measured the same way, is 16 B over memplan too: the gap is not ZeRO's.
    assert abs(predicted.peak_bytes - measured) <= 16, (predicted.peak_bytes, measured)
    assert not dist.is_initialized()  # memplan's fake default group is gone again


def _rank_zero_share(world_size: int, model: torch.nn.Module | None = None) -> list[int]:
    """Element counts of the parameters rank 0 optimizes: largest first, each to the rank with the
    fewest elements so far, the lowest rank among equals (ZeroRedundancyOptimizer's docs and
    _partition_parameters)."""
    totals, mine = [0] * world_size, []
    for numel in sorted((p.numel() for p in (model or Stack()).parameters()), reverse=True):
        rank = totals.index(min(totals))
        totals[rank] += numel
        if rank == 0:
            mine.append(numel)
    return mine


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_the_optimizer_state_is_rank_zeros_share_and_the_rest_is_ddps(world_size):
    ddp = _estimate(parallel="ddp", world_size=world_size)
    zero = _estimate(parallel="zero1", world_size=world_size)
    share = _rank_zero_share(world_size)
    assert zero.breakdown.optimizer_state == sum(2 * 4 * numel + 4 for numel in share)  # two moments, a 0-d step
    model = Stack()
    trainable = sum(p.numel() * 4 for p in model.parameters())
    assert zero.breakdown.gradients == zero.breakdown.communication == trainable  # every gradient, and DDP's buckets
    assert zero.breakdown.parameters == ddp.breakdown.parameters
    if world_size == 1:  # the whole state; not the same peak: the local optimizer takes the parameters
        # largest first, and the real runs (zero_models, and the same with AdamW for ZeRO) differ by the
        # same 64,512 B as the predictions
        assert zero.breakdown.optimizer_state == ddp.breakdown.optimizer_state


@pytest.mark.parametrize(
    ("name", "world_size", "checkpoint", "precision"),
    [("gpt2", 4, "none", "fp32"), ("llama", 2, "all", "amp-bf16"), ("vit", 8, "none", "fp32")],
)
def test_a_zero1_rank_of_an_architecture_is_its_real_run(tiny_model_dirs, name, world_size, checkpoint, precision):
    """`validate --parallel zero1 --device cpu` measures this: rank 0's step run for real on CPU
    tensors under the same fake group."""
    spec = resolve_model(tiny_model_dirs[name])
    options = {"batch_size": 2, "device": "cpu", "checkpoint": checkpoint, "precision": precision}
    settings = spec.settings_for(TrainingSettings(**options, parallel="zero1", world_size=world_size))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    measured = measure_cpu(spec, settings, warmup_iterations=2).peak_bytes
    assert abs(predicted - measured) <= 8, (predicted, measured)


def test_zero1_without_an_optimizer_is_a_settings_error():
    with pytest.raises(SettingsError, match="--parallel zero1 shards the optimizer's state"):
        TrainingSettings(parallel="zero1", world_size=2, optimizer="none")


def test_the_cli_names_the_rank_and_its_total_batch():
    arguments = ["estimate", "tests.ddp_models:stack", "--inputs", SOURCE["inputs"], "--loss", SOURCE["loss"]]
    arguments += ["--device", "cpu", "-b", "16", "--parallel", "zero1", "--world-size", "4"]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # as wrapped to the terminal's width
    assert "one ZeRO-1 (DDP, optimizer state sharded) rank of 4 (total batch 16×1×4 = 64)" in text


def test_zero1_takes_ddp_bucket_views_and_counts_the_gradients_once():
    copies = _estimate(parallel="zero1", world_size=4)
    views = _estimate(parallel="zero1", world_size=4, ddp_bucket_view=True)
    trainable = sum(p.numel() * 4 for p in Stack().parameters())
    assert copies.breakdown.gradients + copies.breakdown.communication == 2 * trainable
    assert views.breakdown.gradients + views.breakdown.communication == trainable


def test_a_process_with_its_own_group_is_refused_in_one_line():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(SettingsError, match="parallel='zero1' runs on a fake process group of 2 ranks"):
            _estimate(parallel="zero1", world_size=2)
    finally:
        dist.destroy_process_group()


def test_paged_adam8bit_pages_the_moments_of_rank_zeros_share():
    """bitsandbytes pages the moments of parameters of 100,000 elements or more (adam8bit.PAGED_MIN_NUMEL):
    on a ZeRO-1 rank, those of its share only (rank 0 of 2 takes the 262,144-element weight, rank 1
    the 131,072-element one)."""
    source = {"inputs": "tests.zero_models:wide_rows", "loss": "tests.ddp_models:mean_square"}
    options = {"batch_size": 4, "optimizer": "paged-adam8bit", "gpu": "A10G", "world_size": 2}
    ddp = memplan.estimate("tests.zero_models:wide", **source, parallel="ddp", **options)
    zero = memplan.estimate("tests.zero_models:wide", **source, parallel="zero1", **options)
    share = _rank_zero_share(2, zero_models.wide())
    assert zero.paged_optimizer_bytes == 2 * sum(numel for numel in share if numel >= 100_000) == 2 * 262_144
    assert ddp.paged_optimizer_bytes == 2 * (262_144 + 131_072)
