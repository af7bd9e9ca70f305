"""--maximize-batch: every option is a fitting plan, the ends are the largest batches estimate finds."""

import json

import pytest
from click.testing import CliRunner

from memplan.api import estimate, plan_batch
from memplan.cli import main

BUDGET = 70 << 20  # where checkpointing buys larger batches (the reserved peak steps with the batch)
SETTINGS = {"seq_len": 128}


@pytest.fixture(scope="module")
def result():
    return plan_batch("tiny-gpt2", budget=BUDGET, **SETTINGS)


def test_every_option_fits_when_estimated_with_its_layout(result):
    assert len(result.options) >= 2
    for option in result.options:
        estimated = estimate("tiny-gpt2", batch_size=option.batch_size, checkpoint=option.plan.layout, **SETTINGS)
        assert estimated.reserved_peak_bytes <= BUDGET
        assert estimated.peak_bytes == option.plan.predicted_peak_bytes
        assert option.samples_per_second == pytest.approx(option.batch_size / estimated.roofline_step_seconds)


def test_ends_are_the_largest_batches_without_and_with_checkpointing(result):
    without = estimate("tiny-gpt2", budget=BUDGET, checkpoint="none", **SETTINGS).max_batch_size
    with_all = estimate("tiny-gpt2", budget=BUDGET, checkpoint="all", **SETTINGS).max_batch_size
    assert result.options[0].batch_size == without and not result.options[0].plan.layout.segments
    assert result.options[-1].batch_size <= with_all
    assert result.best.samples_per_second == max(option.samples_per_second for option in result.options)


def test_cli_json_and_refusals(tmp_path):
    args = ["plan", "tiny-gpt2", "--seq-len", "128", "--budget", str(BUDGET), "--maximize-batch"]
    refused = CliRunner().invoke(main, [*args, "-b", "4"])
    assert refused.exit_code == 2 and "leave out --batch-size" in refused.output
    cpu = CliRunner().invoke(main, [*args, "--device", "cpu"])
    assert cpu.exit_code == 2 and "use it with --device cuda" in cpu.output
    plan_path = tmp_path / "plan.json"
    ran = CliRunner().invoke(main, [*args, "--json", "-o", str(plan_path)])
    assert ran.exit_code == 0, ran.output
    data = json.loads(ran.stdout)
    assert data["best"]["batch_size"] in [option["batch_size"] for option in data["options"]]
    # what fits is the memory each option completes in, which the text shows and the JSON must carry
    assert all(0 < option["smallest_device_bytes"] <= BUDGET for option in data["options"])
    assert json.loads(plan_path.read_text())["settings"]["batch_size"] == data["best"]["batch_size"]


def test_a_budget_past_memplan_s_search_limit_says_larger_batches_may_fit_too():
    from memplan.estimator.search import MAX_BATCH_SIZE

    ran = CliRunner().invoke(main, ["plan", "tiny-gpt2", "--seq-len", "16", "--maximize-batch", "--budget", "1TiB"])
    assert ran.exit_code == 0, ran.output
    assert f"best: batch {MAX_BATCH_SIZE} with 0 blocks checkpointed (memplan's search limit" in ran.stdout
    within = CliRunner().invoke(
        main, ["plan", "tiny-gpt2", "--seq-len", "128", "--budget", str(BUDGET), "--maximize-batch"]
    )
    assert within.exit_code == 0 and "search limit" not in within.stdout


def test_a_budget_below_the_library_workspaces_is_told_what_holds_it():
    """tiny-llama's two cuBLAS workspaces (64 MiB) are more than a 30 MiB budget: the hint was a lower precision or
    a smaller optimizer, neither of which touches them. Following the new hint, batches fit."""
    from memplan.errors import SettingsError

    with pytest.raises(SettingsError, match="cuBLAS and cuDNN workspaces alone take 64.00 MiB of the 30.00 MiB"):
        plan_batch("tiny-llama", seq_len=64, budget="30MiB")
    followed = estimate("tiny-llama", seq_len=64, batch_size=1, budget="30MiB", cublas_workspace_config=":16:8")
    assert followed.fits
