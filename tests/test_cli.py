"""The CLI end to end: JSON output, and one-line errors with the right exit codes."""

import json

import pytest
from click.testing import CliRunner

from memplan.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_estimate_json_has_the_documented_fields(tiny_model_dirs):
    result = run(
        "estimate", tiny_model_dirs["gpt2"], "--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--json"
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert isinstance(data["peak_bytes"], int)
    assert set(data["breakdown"]) == {
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "temporaries",
        "inputs",
    }
    assert sum(data["breakdown"].values()) == data["peak_bytes"]
    assert data["phase"] in ("forward", "backward", "optimizer")
    assert data["settings"]["batch_size"] == 2 and data["settings"]["seq_len"] == 32
    # AdamW in fp32: exp_avg + exp_avg_sq = 2x the parameters, plus a 4-byte step counter per tensor
    parameters, state = data["breakdown"]["parameters"], data["breakdown"]["optimizer_state"]
    assert 0 <= state - 2 * parameters <= 4 * 64
    assert data["per_sample_activation_bytes"] > 0


def test_budget_gives_the_largest_batch_that_fits(tiny_model_dirs):
    model = tiny_model_dirs["gpt2"]
    base = ["estimate", model, "--seq-len", "32", "--device", "cpu", "--json"]
    one = json.loads(run(*base, "--batch-size", "1").stdout)
    budget = one["fixed_bytes"] + 7 * one["per_sample_activation_bytes"] + one["per_sample_activation_bytes"] // 2
    result = run(*base, "--batch-size", "2", "--budget", str(budget))
    assert result.exit_code == 0, result.output
    best = json.loads(result.stdout)["max_batch_size"]
    at_best = json.loads(run(*base, "--batch-size", str(best)).stdout)["peak_bytes"]
    above = json.loads(run(*base, "--batch-size", str(best + 1)).stdout)["peak_bytes"]
    assert at_best <= budget < above


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["estimate", "gtp2"], 2, "did you mean gpt2"),
        (["estimate", "gpt2", "--budget", "12 parsecs"], 2, "cannot read '12 parsecs' as a size"),
        (["estimate", "gpt2", "--batch-size", "0"], 2, "batch size must be a positive integer"),
        (["estimate", "gpt2", "--grad-accum", "-1"], 2, "gradient accumulation steps must be a positive integer"),
        (["estimate", "gpt2", "--seq-len", "4096"], 2, "longer than the model's maximum of 1024"),
        (["estimate", "no_such_pkg.models:build", "--inputs", "x.y:z"], 2, "cannot import module 'no_such_pkg.models'"),
        (["estimate", "tests.zoo_models:conv_bn_net"], 2, "pass --inputs"),
        (
            ["estimate", "tests.zoo_models:conv_bn_net", "--inputs", "tests.zoo_models:inputs_without_batch_size"],
            2,
            "must take one argument, the batch size",
        ),
        (
            [
                "estimate",
                "tests.zoo_models:reused_block",
                "--inputs",
                "tests.zoo_models:features_inputs",
                "--device",
                "cpu",
            ],
            2,
            "not a scalar loss; pass --loss",
        ),
        (
            [
                "estimate",
                "tests.zoo_models:data_dependent",
                "--inputs",
                "tests.zoo_models:features_inputs",
                "--device",
                "cpu",
            ],
            1,
            "aten._local_scalar_dense.default in module DataDependent depends on tensor values",
        ),
    ],
)
def test_user_errors_are_one_line_with_exit_codes(args, code, message):
    result = run(*args)
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback():
    result = CliRunner().invoke(main, ["estimate", "gtp2", "--debug"])
    assert result.exit_code == 2
    assert "Traceback" in result.output


def test_presets_lists_every_shipped_preset():
    result = run("presets")
    assert result.exit_code == 0
    for name in [
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "bert-base-uncased",
        "bert-large-uncased",
        "distilbert-base-uncased",
        "t5-small",
        "t5-base",
        "llama-2-7b",
        "llama-3-8b",
        "mistral-7b",
        "qwen2.5-0.5b",
        "vit-base-patch16-224",
        "resnet-50",
        "resnet-101",
    ]:
        assert name in result.output


def test_api_rejects_unknown_settings():
    import memplan
    from memplan.errors import SettingsError

    with pytest.raises(SettingsError, match="unknown setting"):
        memplan.estimate("gpt2", batch_sise=4)
