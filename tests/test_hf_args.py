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
        ({"optim": "paged_adamw_8bit"}, {"optimizer": "paged-adam8bit", "optimizer_impl": "default"}),
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
        ({"fsdp": "full_shard"}, "sets fsdp, which the Trainer hands to accelerate's FSDP plugin"),
        ({"deepspeed": "ds_config.json"}, "sets deepspeed 'ds_config.json', which is not a file here or beside"),
        ({"deepspeed": {"zero_optimization": {"stage": 0}}}, "runs DeepSpeed's ZeRO stage 0; memplan traces stages 1"),
        ({"bf16": True, "fp16": True}, "sets both bf16 and fp16"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be a positive integer"),
    ],
)
def test_what_cannot_be_modelled_is_a_clear_error(tmp_path, fields, message):
    with pytest.raises(HfArgsError, match=message):
        read_training_args(write(tmp_path, "args.json", fields))


def test_a_trainer_under_deepspeed_zero2_is_one_traced_rank(tmp_path):
    """The Trainer hands bf16 to DeepSpeed (its own, not autocast) and runs DeepSpeed's backward and
    step, not its own clipping loop; the configuration file is found beside the arguments file."""
    write(tmp_path, "ds_config.json", {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}})
    loaded = read_training_args(write(tmp_path, "args.json", {"deepspeed": "ds_config.json", "bf16": True}))
    assert loaded.settings["parallel"] == "zero2" and loaded.settings["precision"] == "bf16"
    assert loaded.settings["loop"] == "canonical"
    assert json.loads(loaded.settings["deepspeed_config"])["zero_optimization"]["reduce_bucket_size"] == 1000
    assert any("world_size" in note for note in loaded.notes)


def test_the_deepspeed_note_asks_for_the_ranks_only_where_they_were_not_given(tmp_path):
    write(tmp_path, "ds_config.json", {"zero_optimization": {"stage": 2}})
    args = write(tmp_path, "args.json", {"deepspeed": "ds_config.json"})
    assert any("give world_size=N" in note for note in read_training_args(args).notes)
    given = read_training_args(args, world_size_given=True).notes
    assert "deepspeed: one ZeRO-2 rank traced with DeepSpeed itself" in given
    # the CLI tells it from the flags typed
    typed = CliRunner().invoke(
        main,
        ["estimate", "tiny-gpt2", "--hf-args", str(args), "--world-size", "4", "--seq-len", "16", "--device", "cpu"],
    )
    assert typed.exit_code == 0, typed.output
    assert "one ZeRO-2 rank traced with DeepSpeed itself" in typed.output and "give --world-size" not in typed.output


def test_a_trainer_in_fp16_under_deepspeed_zero2_traces_deepspeeds_fp16_with_its_accumulation(tmp_path):
    write(tmp_path, "ds_config.json", {"zero_optimization": {"stage": 2}})
    fields = {"deepspeed": "ds_config.json", "fp16": True, "gradient_accumulation_steps": 4}
    loaded = read_training_args(write(tmp_path, "args.json", fields))
    assert loaded.settings["parallel"] == "zero2" and loaded.settings["precision"] == "fp16"
    assert loaded.settings["grad_accum"] == 4


def test_a_trainer_under_deepspeed_stage_1_is_one_traced_deepspeed_zero1_rank(tmp_path):
    write(tmp_path, "ds_config.json", {"zero_optimization": {"stage": 1}})
    loaded = read_training_args(write(tmp_path, "args.json", {"deepspeed": "ds_config.json"}))
    assert loaded.settings["parallel"] == "zero1" and loaded.settings["deepspeed_config"] is not None
    assert any("one ZeRO-1 rank" in note for note in loaded.notes)


def test_a_trainer_under_deepspeed_zero3_is_one_traced_zero3_rank(tmp_path):
    write(tmp_path, "ds_config.json", {"zero_optimization": {"stage": 3}})
    loaded = read_training_args(write(tmp_path, "args.json", {"deepspeed": "ds_config.json"}))
    assert loaded.settings["parallel"] == "zero3"
    assert any("one ZeRO-3 rank" in note for note in loaded.notes)


def test_a_deepspeed_flag_replaces_the_file_s_entry_and_the_run_stays_deepspeed_s(tmp_path):
    """--deepspeed beside --hf-args: the file's stage-3 entry still named the rank ("one ZeRO-3 rank" in a ZeRO-2
    trace's notes) and, without --parallel, refused the flag's file as stage 2 under "--parallel zero3" the user
    never gave; a file without a deepspeed entry set the Trainer's loop, which DeepSpeed's rank refuses."""
    write(tmp_path, "z3.json", {"zero_optimization": {"stage": 3}})
    zero2 = write(tmp_path, "z2.json", {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1500}})
    with_entry = write(tmp_path, "args.json", {"per_device_train_batch_size": 2, "bf16": True, "deepspeed": "z3.json"})
    without = write(tmp_path, "plain.json", {"per_device_train_batch_size": 2, "bf16": True})
    for args in (with_entry, without):
        loaded = read_training_args(args, deepspeed_given=True)
        assert "parallel" not in loaded.settings and "deepspeed_config" not in loaded.settings
        assert loaded.settings["loop"] == "canonical" and loaded.settings["precision"] == "bf16"  # DeepSpeed's bf16
        assert not any("ZeRO" in note for note in loaded.notes)
        flags = ["--hf-args", str(args), "--deepspeed", str(zero2), "--parallel", "zero2", "--world-size", "2"]
        traced = estimate_json(*flags, "--device", "cpu")
        assert traced["settings"]["parallel"] == "zero2" and traced["settings"]["loop"] == "canonical"
        assert not any("ZeRO-3" in note for note in traced["notes"])
    without_parallel = CliRunner().invoke(
        main, ["estimate", "tiny-gpt2", "--hf-args", str(with_entry), "--deepspeed", str(zero2), "--device", "cpu"]
    )
    assert without_parallel.exit_code == 2 and "give --parallel zero1, zero2 or zero3" in without_parallel.output


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


def test_a_step_of_ones_own_replaces_the_trainer_loop_the_file_implies(tmp_path):
    """--hf-args sets the hf-trainer loop; --step replaces the loop, so the two together were refused
    as "leave out --loop", an option the user never gave."""
    path = str(write(tmp_path, "args.json", {"per_device_train_batch_size": 2}))
    assert estimate_json("--hf-args", path, "--device", "cpu")["settings"]["loop"] == "hf-trainer"
    with_step = estimate_json("--hf-args", path, "--device", "cpu", "--step", "tests.custom_steps:canonical")
    assert with_step["settings"]["step"] == "tests.custom_steps:canonical"
    assert with_step["settings"]["loop"] == "canonical" and with_step["settings"]["batch_size"] == 2


def test_the_files_notes_go_with_a_json_answer(tmp_path):
    """--json printed none of the file's notes (what memplan does not model of it): an estimate carries them
    in its notes; a sweep, whose result has none, prints them on stderr, apart from its JSON."""
    path = str(write(tmp_path, "args.json", {"per_device_train_batch_size": 2, "torch_compile": True}))
    notes = estimate_json("--hf-args", path, "--device", "cpu", "--no-cache")["notes"]
    assert any(note.startswith("torch_compile is not modelled") for note in notes)
    swept = CliRunner().invoke(
        main,
        [
            "sweep",
            "tiny-gpt2",
            "--seq-len",
            "32",
            "--device",
            "cpu",
            "--batch-sizes",
            "1,2",
            "--hf-args",
            path,
            "--json",
        ],
    )
    assert swept.exit_code == 0, swept.output
    assert json.loads(swept.stdout)["series"] and "torch_compile is not modelled" in swept.stderr


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

    from memplan.hf_args import NEWER_READ_KEYS, READ_KEYS

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    # every key memplan reads is a real field (a misspelt one would never match); the newer ones in newer releases
    assert READ_KEYS - NEWER_READ_KEYS <= fields
    assert NEWER_READ_KEYS <= fields or not NEWER_READ_KEYS & fields
    typo = write(tmp_path, "typo.json", {**TRAINING_ARGS, "gradient_acumulation_steps": 2})
    file = "TrainingArguments file"  # as Python callers read it; the CLI says --hf-args
    with pytest.raises(HfArgsError, match=f"^{file} {typo}: 'gradient_acumulation_steps' is not a Train"):
        read_training_args(typo)
    with pytest.raises(HfArgsError, match="did you mean 'gradient_accumulation_steps'"):
        read_training_args(typo)
    old = write(tmp_path, "old.json", {**TRAINING_ARGS, "evaluation_strategy": "steps", "my_key": 1})
    notes = " ".join(read_training_args(old).notes)
    assert "evaluation_strategy (did you mean eval_strategy?)" in notes and "my_key" in notes
    assert "output_dir" not in notes and "learning_rate" not in notes  # real fields are not listed


def test_without_full_determinism_or_tf32_the_torch_defaults_stand(tmp_path):
    settings = read_training_args(write(tmp_path, "args.json", {"full_determinism": False})).settings
    assert not {"deterministic", "cudnn_benchmark", "cublas_workspace_config", "cudnn_allow_tf32"} & set(settings)


def test_a_file_that_cannot_be_read_names_itself_and_why(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(HfArgsError, match=f"^cannot read TrainingArguments file {missing}: No such file or directory$"):
        read_training_args(missing)
    listed = write(tmp_path, "list.json", {})
    listed.write_text("[1, 2]")
    with pytest.raises(HfArgsError, match=f"^TrainingArguments file {listed} must hold one mapping of Training"):
        read_training_args(listed)


def test_the_suffix_picks_the_parser_and_errors_keep_their_first_line(tmp_path):
    yaml_text = "per_device_train_batch_size: 3\n"
    for name in ("args.yml", "args.yaml", "ARGS.YML"):
        (tmp_path / name).write_text(yaml_text)
        assert read_training_args(tmp_path / name).settings["batch_size"] == 3
    as_json = tmp_path / "args.json"
    as_json.write_text(yaml_text)  # YAML in a .json file is read as JSON, and is not valid JSON
    with pytest.raises(HfArgsError) as error:
        read_training_args(as_json)
    expected = f"TrainingArguments file {as_json} is not valid JSON: Expecting value: line 1 column 1 (char 0)"
    assert str(error.value) == expected
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1,\n")
    with pytest.raises(HfArgsError) as error:
        read_training_args(broken)
    message = str(error.value)
    assert message.startswith(f"TrainingArguments file {broken} is not valid YAML: ") and "\n" not in message


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("yes", True), ("YES ", True), ("no", False), (0, False)])
def test_flags_read_as_trainingarguments_strings_do(tmp_path, value, expected):
    settings = read_training_args(write(tmp_path, "args.json", {"gradient_checkpointing": value})).settings
    assert ("checkpoint" in settings) is expected


def test_counts_are_positive_integers_and_messages_name_the_file(tmp_path):
    one = read_training_args(
        write(tmp_path, "one.json", {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1})
    )
    assert one.settings["batch_size"] == 1 and one.settings["grad_accum"] == 1
    assert one.path == str(tmp_path / "one.json")
    for key, value in (("per_device_train_batch_size", True), ("gradient_accumulation_steps", 0)):
        path = write(tmp_path, f"{key}.json", {key: value})
        message = f"^TrainingArguments file {path}: {key} must be a positive integer, got {value!r}$"
        with pytest.raises(HfArgsError, match=message):
            read_training_args(path)


def test_sgd_momentum_is_read_from_optim_args(tmp_path):
    def optimizer(optim_args):  # type: ignore[no-untyped-def]
        data = {"optim": "sgd"} if optim_args is None else {"optim": "sgd", "optim_args": optim_args}
        return read_training_args(write(tmp_path, "args.json", data)).settings["optimizer"]

    assert optimizer("momentum=9E-1") == "sgd-momentum"
    assert optimizer("nesterov=True, momentum=0.9") == "sgd-momentum"
    assert optimizer("momentum=0") == "sgd"
    assert optimizer("nesterov=True") == "sgd"
    assert optimizer(None) == "sgd"


def test_notes_say_what_is_read_differently_or_not_modelled(tmp_path):
    def notes(data):  # type: ignore[no-untyped-def]
        return read_training_args(write(tmp_path, "args.json", data)).notes

    assert notes({"optim": "adafactor"}) == (
        "optim adafactor is transformers' Adafactor; memplan traces torch.optim.Adafactor, whose factored "
        "state has the same shapes",
    )
    assert notes({}) == ()  # max_grad_norm defaults to 1.0: clipping on, nothing to say
    assert notes({"max_grad_norm": 0}) == (
        "max_grad_norm 0 turns Trainer's clipping off; memplan traces it anyway (a few scalars in excess)",
    )
    assert notes({"torch_compile": True}) == (
        "torch_compile is not modelled: memplan predicts the eager step, compiled steps usually use less",
    )
    assert notes({"my_key": 1, "other_key": 2}) == (
        "not TrainingArguments fields in this transformers, so ignored: my_key, other_key",
    )
    # 'optimizer' is 0.71 similar to the read field 'optim': below the 0.8 cutoff, so a note, not an error.
    assert "optimizer" in notes({"optimizer": "adamw"})[0]


def test_an_unreadable_optim_says_how_to_override_it(tmp_path):
    path = write(tmp_path, "args.json", {"optim": "lion_8bit"})
    with pytest.raises(HfArgsError, match=r"\(or pass optimizer to override the file\)$"):
        read_training_args(path)


def test_reentrant_checkpointing_asked_for_is_noted_as_traced_non_reentrant(tmp_path):
    path = tmp_path / "args.json"
    path.write_text(
        json.dumps({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}})
    )
    read = read_training_args(path)
    assert read.settings["checkpoint"] == "all"
    assert any("use_reentrant: true is traced as a non-reentrant checkpoint" in note for note in read.notes)
    path.write_text(
        json.dumps({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}})
    )
    assert not any("reentrant" in note for note in read_training_args(path).notes)


@pytest.mark.parametrize("given", [None, 5, b"args.json"])
def test_a_file_that_is_no_path_is_one_line_from_python(given):
    with pytest.raises(HfArgsError, match="a TrainingArguments file is a path"):
        read_training_args(given)


def test_python_callers_read_of_the_file_not_of_a_flag(tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"bf16": True, "fp16": True}))
    with pytest.raises(HfArgsError, match=f"^TrainingArguments file {path} sets both bf16 and fp16"):
        read_training_args(path)
    shown = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "--hf-args", str(path)])
    assert shown.exit_code == 2 and f"--hf-args {path} sets both bf16 and fp16" in shown.output


def test_a_file_of_a_newer_transformers_is_read_with_a_note(tmp_path, monkeypatch):
    """A file saved by transformers 5.25 or later, read where TrainingArguments has only the old name (5.17, which CI's
    second leg and the GPU machine run): its activation_checkpointing had been listed as an unknown field and dropped
    (traced unchecked, 35-38% high) and its kwargs refused as a misspelling of gradient_checkpointing_kwargs."""
    import memplan.hf_args as hf_args

    fields = tuple(field for field in hf_args.training_argument_fields() if field not in hf_args.NEWER_READ_KEYS)
    monkeypatch.setattr(hf_args, "training_argument_fields", lambda: fields)
    read = read_training_args(
        write(tmp_path, "args.json", {"activation_checkpointing": True, "activation_checkpointing_kwargs": {}})
    )
    assert read.settings["checkpoint"] == "all"
    assert any(
        note.startswith("activation_checkpointing, activation_checkpointing_kwargs: read as") for note in read.notes
    )
    assert not any("not TrainingArguments fields" in note for note in read.notes)


@pytest.mark.parametrize(
    ("fields", "checkpointed"),
    [
        ({"activation_checkpointing": True}, True),
        ({"activation_checkpointing": "true"}, True),
        ({"gradient_checkpointing": True}, True),  # the deprecated alias, where the new name is not set
        ({"activation_checkpointing": None, "gradient_checkpointing": True}, True),
        # a file that sets both: TrainingArguments takes the new name's value, as saved files hold it
        ({"activation_checkpointing": False, "gradient_checkpointing": True}, False),
        ({"activation_checkpointing": True, "gradient_checkpointing": False}, True),
    ],
)
def test_activation_checkpointing_and_its_alias_are_read_as_training_arguments_reads_them(
    tmp_path, fields, checkpointed
):
    settings = read_training_args(write(tmp_path, "args.json", fields)).settings
    assert (settings.get("checkpoint") == "all") is checkpointed


def test_activation_checkpointing_kwargs_are_read_as_the_trainer_reads_them(tmp_path):
    """The Trainer pops every_n_layers and offload from them (trainer.py) and hands the rest to torch's checkpoint."""

    def read(kwargs):  # type: ignore[no-untyped-def]
        return read_training_args(write(tmp_path, "args.json", {"activation_checkpointing": True, **kwargs}))

    assert any(
        "use_reentrant: true" in note
        for note in read({"activation_checkpointing_kwargs": {"use_reentrant": True}}).notes
    )
    as_string = read({"activation_checkpointing_kwargs": '{"use_reentrant": true}'})  # TrainingArguments parses it
    assert any("activation_checkpointing_kwargs use_reentrant: true" in note for note in as_string.notes)
    # the alias's kwargs where the new name's are not set
    assert any(
        "gradient_checkpointing_kwargs use_reentrant" in note
        for note in read({"gradient_checkpointing_kwargs": {"use_reentrant": True}}).notes
    )
    offloaded = read({"activation_checkpointing_kwargs": {"offload": True}})
    assert offloaded.settings["checkpoint"] == "all"
    assert any(
        "offload: true keeps the checkpointed layers' inputs in pinned host memory" in n for n in offloaded.notes
    )
    every_layer = read({"activation_checkpointing_kwargs": {"every_n_layers": 1}}).notes
    assert [note for note in every_layer if "read as transformers 5.25" not in note] == []  # the older release's note
    with pytest.raises(HfArgsError, match="every_n_layers 2 checkpoints only some layers"):
        read({"activation_checkpointing_kwargs": {"every_n_layers": 2}})


def test_label_smoothing_factor_is_the_trainers_loss_in_its_loop(tmp_path):
    settings = read_training_args(write(tmp_path, "args.json", {"label_smoothing_factor": 0.1})).settings
    assert settings["label_smoothing"] == 0.1 and settings["loop"] == "hf-trainer"
    assert (
        "label_smoothing"
        not in read_training_args(write(tmp_path, "args.json", {"label_smoothing_factor": 0})).settings
    )
    with pytest.raises(HfArgsError, match="label_smoothing_factor must be a number, 0 or more"):
        read_training_args(write(tmp_path, "args.json", {"label_smoothing_factor": -0.1}))
    write(tmp_path, "ds_config.json", {"zero_optimization": {"stage": 2}})
    with pytest.raises(HfArgsError, match="sets label_smoothing_factor under DeepSpeed"):
        read_training_args(write(tmp_path, "args.json", {"label_smoothing_factor": 0.1, "deepspeed": "ds_config.json"}))
    # the settings take it in the Trainer's loop only; a step of one's own computes its own loss
    from memplan.errors import SettingsError
    from memplan.settings import TrainingSettings

    with pytest.raises(SettingsError, match="label smoothing is transformers' Trainer's"):
        TrainingSettings(label_smoothing=0.1)
    path = str(write(tmp_path, "args.json", {"label_smoothing_factor": 0.1}))
    with_step = estimate_json("--hf-args", path, "--device", "cpu", "--step", "tests.custom_steps:canonical")
    assert with_step["settings"]["label_smoothing"] == 0.0


@pytest.mark.parametrize(
    ("fields", "device", "note"),
    [
        ({"neftune_noise_alpha": 5.0}, "cpu", "neftune_noise_alpha: the Trainer's NEFTune hook"),
        ({"use_liger_kernel": True}, "cpu", "use_liger_kernel is not modelled"),
        ({"use_cache": True}, "cpu", "use_cache: true lets the model fill a key/value cache"),
        ({"torch_empty_cache_steps": 4}, "cuda", "torch_empty_cache_steps: the Trainer empties the CUDA cache"),
        ({"torch_compile_mode": "max-autotune"}, "cpu", "torch_compile_mode is not modelled"),
        ({"torch_compile_backend": "inductor"}, "cpu", "torch_compile_backend is not modelled"),
    ],
)
def test_fields_that_change_memory_unmodelled_are_noted(tmp_path, fields, device, note):
    notes = read_training_args(write(tmp_path, "args.json", fields), device=device).notes
    assert len(notes) == 1 and notes[0].startswith(note)


def test_fields_that_do_not_change_one_ranks_memory_are_not_noted(tmp_path):
    """Measured against the Trainer on the CPU (helper's hunt): neither moved the step's peak by a byte."""
    fields = {"average_tokens_across_devices": False, "torch_empty_cache_steps": 1, "use_cache": False}
    assert read_training_args(write(tmp_path, "args.json", fields), device="cpu").notes == ()
