"""The settings line over every estimate (memplan.render.estimate.describe_settings): each setting that changes
the answer is named, so two results are never told apart only by flags the header leaves out. And the table under
it: its rows are the breakdown, all of it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.render.estimate import describe_settings
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({"lora_rank": 8, "quantize": "nf4", "precision": "amp-bf16"}, "LoRA r=8 on an nf4-quantized base (QLoRA)"),
        ({"checkpoint": "selective"}, "selective checkpointing"),
        ({"checkpoint": "all"}, "checkpoint all blocks"),
        ({"loop": "hf-trainer"}, "hf-trainer loop"),
        ({"step": "mine.train:step", "device": "cpu"}, "--step mine.train:step"),
    ],
)
def test_a_setting_that_changes_the_answer_is_in_the_header(options, shown):
    assert shown in describe_settings(TrainingSettings(**options))


def test_the_defaults_add_nothing():
    assert describe_settings(TrainingSettings()) == "batch 1, fp32, adamw, target cuda"


def test_a_sweep_s_header_gives_no_batch_of_its_own():
    """A sweep's rows each have their micro-batch: its header said "(total batch 1×2×4 = 8)" from the unused -b 1."""
    settings = TrainingSettings(parallel="ddp", world_size=4, grad_accum=2)
    assert describe_settings(settings, with_batch=False).endswith("(total batch micro-batch×2×4)")
    assert describe_settings(settings.replace(batch_size=3)).endswith("(total batch 3×2×4 = 24)")


def test_the_cpu_table_shows_a_librarys_workspaces_so_its_rows_add_up_to_the_peak(tiny_model_dirs):
    common = ["estimate", tiny_model_dirs["gpt2"], "--seq-len", "16", "--device", "cpu", "--no-cache"]
    common += ["--lora", "4", "--quantize", "nf4", "--checkpoint", "all"]
    figures = json.loads(CliRunner().invoke(main, [*common, "--json"]).stdout)
    workspaces = figures["breakdown"]["workspaces"]
    assert workspaces > 0  # bitsandbytes' 4-bit matmul temporaries at the peak
    assert sum(figures["breakdown"].values()) == figures["peak_bytes"]
    text = CliRunner().invoke(main, common).stdout
    row = next(line for line in text.splitlines() if "workspaces" in line)
    assert format_bytes(workspaces) in row and "cuBLAS" not in row
