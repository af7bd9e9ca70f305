"""--hf-args: TrainingArguments files give the same settings, and the same estimate, as the flags."""

import json

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import HfArgsError
from memplan.hf_args import read_training_args

TRAINING_ARGS = {  # as TrainingArguments.to_json_string() writes them (a subset of its ~120 fields)
    "output_dir": "out",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 8,
    "gradient_checkpointing": True,
    "bf16": True,
    "fp16": False,
    "optim": "adamw_torch_fused",
    "max_grad_norm": 1.0,
    "fsdp": [],
    "deepspeed": None,
    "learning_rate": 5e-05,
}
EQUIVALENT_FLAGS = [
    "-b", "4", "--grad-accum", "8", "--checkpoint", "all", "--precision", "amp-bf16",
    "--optimizer", "adamw", "--optimizer-impl", "fused", "--loop", "hf-trainer",
]  # fmt: skip


def write(tmp_path, name, data):
    path = tmp_path / name
    if name.endswith((".yaml", ".yml")):
        import yaml

        path.write_text(yaml.safe_dump(data))
    else:
        path.write_text(json.dumps(data))
    return path


def test_json_and_yaml_give_the_same_settings(tmp_path):
    from_json = read_training_args(write(tmp_path, "args.json", TRAINING_ARGS))
    from_yaml = read_training_args(write(tmp_path, "args.yaml", TRAINING_ARGS))
    assert (
        from_json.settings
        == from_yaml.settings
        == {
            "batch_size": 4,
            "grad_accum": 8,
            "checkpoint": "all",
            "precision": "amp-bf16",
            "optimizer": "adamw",
            "optimizer_impl": "fused",
            "loop": "hf-trainer",
        }
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"optimizer": "adamw", "optimizer_impl": "fused"}),  # TrainingArguments' default optim
        ({"optim": "adamw_torch"}, {"optimizer": "adamw", "optimizer_impl": "default"}),
        ({"optim": "adafactor"}, {"optimizer": "adafactor", "optimizer_impl": "default"}),
        ({"optim": "adamw_bnb_8bit"}, {"optimizer": "adam8bit", "optimizer_impl": "default"}),
        ({"optim": "sgd"}, {"optimizer": "sgd", "optimizer_impl": "default"}),
        ({"optim": "sgd", "optim_args": "momentum=0.9"}, {"optimizer": "sgd-momentum", "optimizer_impl": "default"}),
        ({"fp16": True}, {"precision": "amp-fp16"}),
        ({"bf16": "true"}, {"precision": "amp-bf16"}),
        # trainer_utils.enable_full_determinism: deterministic algorithms, benchmark off, ":16:8" for cuBLAS.
        (
            {"full_determinism": True},
            {"deterministic": True, "cudnn_benchmark": False, "cublas_workspace_config": ":16:8"},
        ),
        ({"tf32": False}, {"cudnn_allow_tf32": False}),
        ({"tf32": True}, {"cudnn_allow_tf32": True}),
    ],
)
def test_fields_map_to_settings(tmp_path, fields, expected):
    settings = read_training_args(write(tmp_path, "args.json", fields)).settings
    assert {key: settings[key] for key in expected} == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"optim": "lion_8bit"}, "cannot model optim 'lion_8bit'; it models adamw_torch, adamw_torch_fused"),
        ({"fsdp": "full_shard"}, "sets fsdp; memplan models one GPU"),
        ({"bf16": True, "fp16": True}, "sets both bf16 and fp16"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be a positive integer"),
    ],
)
def test_what_cannot_be_modelled_is_a_clear_error(tmp_path, fields, message):
    with pytest.raises(HfArgsError, match=message):
        read_training_args(write(tmp_path, "args.json", fields))


def estimate_json(*args):
    result = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "--seq-len", "32", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_file_equals_flags_and_typed_flags_override(tmp_path):
    path = str(write(tmp_path, "args.json", TRAINING_ARGS))
    from_file = estimate_json("--hf-args", path)
    from_flags = estimate_json(*EQUIVALENT_FLAGS)
    assert from_file["settings"] == from_flags["settings"]
    assert from_file["peak_bytes"] == from_flags["peak_bytes"]
    overridden = estimate_json("--hf-args", path, "-b", "2", "--optimizer", "sgd")
    assert overridden["settings"]["batch_size"] == 2 and overridden["settings"]["grad_accum"] == 8
    # the file's fused implementation belongs to its optimizer; a typed --optimizer takes torch's default
    assert overridden["settings"]["optimizer"] == "sgd" and overridden["settings"]["optimizer_impl"] == "default"


def test_cli_errors_are_one_line_with_exit_2(tmp_path):
    path = write(tmp_path, "args.yaml", {"optim": "galore_adamw"})
    result = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "--hf-args", str(path)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "memplan cannot model optim 'galore_adamw'" in result.output
    # naming an optimizer on the command line makes the file's optim irrelevant
    typed = CliRunner().invoke(
        main, ["estimate", "tiny-gpt2", "--seq-len", "32", "--hf-args", str(path), "--optimizer", "sgd"]
    )
    assert typed.exit_code == 0, typed.output


def test_a_file_that_is_not_utf8_is_a_clear_error(tmp_path):
    path = tmp_path / "args.json"
    path.write_bytes(json.dumps(TRAINING_ARGS).encode("utf-16"))  # PowerShell's Out-File default
    with pytest.raises(HfArgsError, match="is not UTF-8 text"):
        read_training_args(path)


def test_a_misspelt_memory_field_is_an_error_and_other_unknown_keys_are_noted(tmp_path):
    import dataclasses

    from transformers import TrainingArguments

    from memplan.hf_args import READ_KEYS

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    assert READ_KEYS <= fields  # every key memplan reads is a real field (a misspelt one would never match)
    typo = write(tmp_path, "typo.json", {**TRAINING_ARGS, "gradient_acumulation_steps": 2})
    with pytest.raises(HfArgsError, match="did you mean 'gradient_accumulation_steps'"):
        read_training_args(typo)
    old = write(tmp_path, "old.json", {**TRAINING_ARGS, "evaluation_strategy": "steps", "my_key": 1})
    notes = " ".join(read_training_args(old).notes)
    assert "evaluation_strategy (did you mean eval_strategy?)" in notes and "my_key" in notes
    assert "output_dir" not in notes and "learning_rate" not in notes  # real fields are not listed


def test_without_full_determinism_or_tf32_the_torch_defaults_stand(tmp_path):
    settings = read_training_args(write(tmp_path, "args.json", {"full_determinism": False})).settings
    assert not {"deterministic", "cudnn_benchmark", "cublas_workspace_config", "cudnn_allow_tf32"} & set(settings)
