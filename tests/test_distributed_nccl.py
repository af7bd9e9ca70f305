"""NCCL's buffers on a data-parallel rank (memplan.distributed.nccl): modelled, not traced.

Truth: the sizes NCCL's source gives, worked out here by hand from the quantities its files name
(src/init.cc's protocol buffer sizes, src/transport/p2p.cc's rounding to CUDA IPC's 2 MiB,
src/transport/nvls.cc), not from memplan's constants; and the device figure and the budget as
plain sums of what the estimate reports beside them."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import memplan
from memplan.cli import main
from memplan.distributed.nccl import NcclConfig, communicator_band
from memplan.errors import SettingsError
from memplan.gpus import gpu_named

MiB = 1 << 20
SOURCE = {"inputs": "tests.ddp_models:rows", "loss": "tests.ddp_models:mean_square"}

# One channel's connection to one peer: LL (8 lines x 512 threads x 8 steps x 16 B = 512 KiB),
# LL128 (120 elements x 640 threads x 8 steps x 8 B = 4,915,200 B) and Simple (4 MiB) received,
# 9,633,792 B and a header rounded up to 2 MiB = 10 MiB; the send side 2 MiB.
CONNECTION = 10 * MiB + 2 * MiB


# Rings on the search's one channel doubled (one connection each); rings (one) and trees (a chain in a
# node: two; across nodes up to three children and a parent: four) on 32 channels.
LOW = 2 * 1 * CONNECTION
TOP_IN_NODE = 32 * (1 + 2) * CONNECTION  # 1,152 MiB
TOP_ACROSS_NODES = 32 * (1 + 4) * CONNECTION
NVLS_8 = 16 * 2 * (128 * 1024 * 8) * 8  # 16 channels x 2 x 1 MiB x 8 GPUs: 256 MiB


@pytest.mark.parametrize(
    ("world_size", "gpu", "expected"),
    [
        (1, "H100-80GB", (0, 0)),  # no peer, nothing to connect
        (2, "T4", (LOW, TOP_IN_NODE)),
        (2, "H100-80GB", (LOW, TOP_IN_NODE)),  # NVLS needs 3 GPUs in the node
        (3, "H100-80GB", (LOW, TOP_IN_NODE + 16 * 2 * MiB * 3)),
        (4, "A100-40GB", (LOW, TOP_IN_NODE)),  # NVLS needs Hopper
        (8, "H100-80GB", (LOW, TOP_IN_NODE + NVLS_8)),
        (64, "H200", (LOW, TOP_ACROSS_NODES + NVLS_8)),  # trees span nodes; NVLS one node's 8 GPUs
        (16, "A100-80GB", (LOW, TOP_ACROSS_NODES)),
    ],
)
def test_the_band_is_what_nccls_buffer_sizes_give(world_size, gpu, expected):
    band = communicator_band(world_size, gpu_named(gpu).compute_capability)
    assert band == expected and all(isinstance(end, int) for end in band)  # whole bytes, as the JSON gives them


def test_a_published_measurement_falls_inside_the_band():
    """NVIDIA/nccl#964: 688 MB of NCCL memory per process in a group of four NVLink A100s."""
    low, high = communicator_band(4, gpu_named("A100-40GB").compute_capability)
    assert low <= 688 * 10**6 <= high


def test_the_device_figure_and_the_budget_count_the_bands_top():
    card = gpu_named("A100-40GB")
    ranked = memplan.estimate(
        "tests.ddp_models:stack", **SOURCE, batch_size=16, gpu="A100-40GB", parallel="ddp", world_size=8
    )
    top = TOP_IN_NODE
    assert (ranked.communicator_low_bytes, ranked.communicator_bytes) == (2 * CONNECTION, top)
    context = ranked.settings.context_bytes
    assert ranked.device_peak_bytes == ranked.reserved_peak_bytes + context + top
    assert ranked.budget_bytes == card.total_bytes - context - top

    given = memplan.estimate(
        "tests.ddp_models:stack",
        **SOURCE,
        batch_size=16,
        gpu="A100-40GB",
        parallel="ddp",
        world_size=8,
        nccl_memory="100MiB",
    )
    assert (given.communicator_low_bytes, given.communicator_bytes) == (100 * MiB, 100 * MiB)
    assert given.device_peak_bytes == given.reserved_peak_bytes + context + 100 * MiB
    assert given.budget_bytes == card.total_bytes - context - 100 * MiB
    assert given.reserved_peak_bytes == ranked.reserved_peak_bytes  # torch's own memory does not move

    on_cpu = memplan.estimate("tests.ddp_models:stack", **SOURCE, batch_size=16, device="cpu", parallel="ddp")
    assert (on_cpu.communicator_low_bytes, on_cpu.communicator_bytes, on_cpu.device_peak_bytes) == (None, None, None)

    alone = memplan.estimate("tests.ddp_models:stack", **SOURCE, batch_size=16, gpu="A100-40GB")
    assert alone.communicator_bytes is None
    assert alone.device_peak_bytes == alone.reserved_peak_bytes + context
    assert alone.budget_bytes == card.total_bytes - context


def test_nccl_memory_without_a_data_parallel_cuda_rank_is_refused():
    for settings, reason in (
        ({}, "a data-parallel job: give parallel="),
        # not "give --parallel ddp, ..." to a rank that had it: the cpu target is what is wrong
        ({"parallel": "ddp", "world_size": 2, "device": "cpu"}, "device='cpu' traces no GPU"),
    ):
        with pytest.raises(SettingsError, match=f"nccl_memory sizes what NCCL holds on one GPU.*{reason}"):
            memplan.estimate("tests.ddp_models:stack", **SOURCE, batch_size=2, nccl_memory="1GiB", **settings)
    with pytest.raises(SettingsError, match="NCCL memory must be"):
        memplan.estimate("tests.ddp_models:stack", **SOURCE, batch_size=2, parallel="ddp", nccl_memory=-1)
    done = CliRunner().invoke(main, ["estimate", "tests.ddp_models:stack", "-b", "2", "--nccl-memory", "1GiB"])
    assert done.exit_code == 2 and "--nccl-memory" in done.output and "Traceback" not in done.output


def test_the_table_shows_the_band_and_the_device_total_says_it_counts_nccl():
    done = CliRunner().invoke(
        main,
        ["estimate", "tests.ddp_models:stack", "--inputs", SOURCE["inputs"], "--loss", SOURCE["loss"], "-b", "4"]
        + ["--parallel", "fsdp", "--world-size", "8", "--gpu", "H100", "--no-cache"],
        env={"COLUMNS": "160"},
    )
    assert done.exit_code == 0, done.output
    assert "NCCL buffers (modelled top; at least 24.00 MiB)" in done.output
    assert "1.38 GiB" in done.output  # 1,152 MiB of rings and trees + 256 MiB of NVLS on 8 Hopper GPUs
    assert "CUDA context and NCCL (nvidia-smi)" in done.output


def test_validation_leaves_nccl_out_of_the_device_figure_it_compares(monkeypatch):
    """A measured rank runs on torch's fake process group, which makes no NCCL communicator: the
    prediction it is compared with is reserved + the CUDA context alone."""
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings
    from memplan.validate import runner

    monkeypatch.setattr(runner, "measure_in_subprocess", lambda *args, **kwargs: {"device_used_bytes": 1})
    spec = resolve_model("tests.ddp_models:stack", inputs=SOURCE["inputs"], loss=SOURCE["loss"])
    settings = TrainingSettings(batch_size=16, gpu="A100-40GB", parallel="ddp", world_size=8)
    validated = runner.validate_config(spec, settings)
    estimated = memplan.estimate(
        "tests.ddp_models:stack", **SOURCE, batch_size=16, gpu="A100-40GB", parallel="ddp", world_size=8
    )
    assert validated.predicted_device_bytes == estimated.reserved_peak_bytes + estimated.settings.context_bytes


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # NCCL_BUFFSIZE 2 MiB: 524,288 + 4,915,200 + 2,097,152 = 7,536,640 B received, rounded up to 8 MiB;
        # with the 2 MiB sent, 10 MiB a connection.
        (NcclConfig(buffsize_bytes=2 * MiB), (2 * 10 * MiB, 32 * 3 * 10 * MiB + NVLS_8)),
        # NCCL_MAX_CTAS 8 caps the rings, the trees and NVLS's 16 channels alike.
        (NcclConfig(max_ctas=8), (LOW, 8 * 3 * CONNECTION + 8 * 2 * MiB * 8)),
        (NcclConfig(max_ctas=1), (1 * CONNECTION, 1 * 3 * CONNECTION + 1 * 2 * MiB * 8)),
        (NcclConfig(nvls=False), (LOW, TOP_IN_NODE)),  # NCCL_NVLS_ENABLE=0
    ],
)
def test_the_jobs_nccl_variables_resize_the_band(config, expected):
    assert communicator_band(8, gpu_named("H100-80GB").compute_capability, config) == expected


def test_nccl_variables_come_from_the_environment_for_a_data_parallel_rank_only():
    command = ["estimate", "tests.ddp_models:stack", "--inputs", SOURCE["inputs"], "--loss", SOURCE["loss"], "-b", "4"]
    rank = ["--parallel", "fsdp", "--world-size", "8", "--gpu", "H100", "--no-cache", "--json"]
    environment = {"NCCL_NVLS_ENABLE": "0", "NCCL_MAX_CTAS": "8"}
    done = CliRunner().invoke(main, command + rank, env=environment)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["communicator_bytes"] == 8 * 3 * CONNECTION  # 8 channels, no NVLS
    # NCCL_MAX_NCHANNELS, the older name, sets the same cap, and the message names the variable that did.
    older = CliRunner().invoke(main, command + rank[:-1], env={"NCCL_MAX_NCHANNELS": "8"})
    assert "from the environment: NCCL_MAX_NCHANNELS=8" in older.stderr
    assert "NCCL_MAX_CTAS=8 (modelled" in " ".join(older.stdout.split())  # the cap, as the note names it
    # The same shell running a single-GPU estimate: the variables mean nothing there and are set aside.
    alone = CliRunner().invoke(main, command + ["--no-cache", "--json"], env=environment)
    assert alone.exit_code == 0, alone.output
    assert json.loads(alone.stdout)["settings"]["nccl_max_ctas"] is None
    # Given as flags without --parallel, they are a mistake.
    refused = CliRunner().invoke(main, command + ["--no-nccl-nvls"])
    assert refused.exit_code == 2 and "--no-nccl-nvls" in refused.output


def test_a_job_of_one_rank_is_told_it_has_no_nccl_buffers():
    """The note said "NCCL's communicator holds 0 B to 0 B ... give yours with --nccl-memory"."""
    alone = memplan.estimate("tests.ddp_models:stack", **SOURCE, batch_size=2, parallel="ddp", world_size=1)
    assert alone.communicator_bytes == 0
    assert "NCCL: a job of one rank has no peer to exchange with, so no NCCL buffers are counted" in alone.notes
    assert not any("0 B to 0 B" in note for note in alone.notes)
