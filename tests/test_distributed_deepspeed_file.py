"""What a DeepSpeed configuration says about memplan's own settings (memplan.distributed.deepspeed_file): the
precision it enables outright must be --precision's, and the batch, accumulation and optimizer it gives are
replaced by memplan's options, said so in a note."""

from __future__ import annotations

import json
import re

import pytest

from memplan.distributed.deepspeed_file import file_precision, parse_deepspeed_config, replaced_values
from memplan.errors import SettingsError
from memplan.estimator.notes import settings_notes
from memplan.settings import TrainingSettings


@pytest.mark.parametrize(
    ("config", "precision"),
    [
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"bfloat16": {"enabled": True}}, "bf16"),  # DeepSpeed's older name for the section
        ({"fp16": {"enabled": True, "loss_scale": 0}}, "fp16"),
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "amp-bf16"),
        ({"torch_autocast": {"enabled": True, "dtype": "bf16"}}, "amp-bf16"),
        ({"torch_autocast": {"enabled": True, "dtype": "half"}}, "amp-fp16"),  # DeepSpeed's DtypeEnum names
        ({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}, "amp-fp16"),
        # DeepSpeed tests torch_autocast's "enabled" for truth, and no Trainer fills it: "auto" turns it on
        ({"torch_autocast": {"enabled": "auto", "dtype": "float16"}}, "amp-fp16"),
        ({"torch_autocast": {"enabled": False, "dtype": "float16"}}, None),
        ({"bf16": {"enabled": "auto"}}, None),  # the Trainer's to fill
        ({"bf16": {"enabled": "yes"}}, "bf16"),  # pydantic's bool, as DeepSpeed's section model reads it
        ({"fp16": {"enabled": "off"}}, None),
        ({"bf16": None, "bfloat16": {"enabled": True}}, "bf16"),
        ({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}, None),  # the older name only without bf16
        # a section without "enabled" is off, as each of DeepSpeed's defaults has it
        ({"bf16": {"immediate_grad_update": True}}, None),
        ({"fp16": {}}, None),
        ({"torch_autocast": {"dtype": "bfloat16"}}, None),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": False}}, None),
        ({"zero_optimization": {"stage": 2}}, None),
    ],
)
def test_the_precision_a_file_enables(config, precision):
    assert file_precision(config) == precision


ENABLED_VALUES = [True, False, 1, 0, 1.0, 0.0, 2, "yes", "No", "ON", "off", "t", "F", "1", "0", "true", "FALSE"]
ENABLED_VALUES += ["auto", "AUTO", " yes", "", "enabled", None, [], {}]


@pytest.mark.parametrize("value", ENABLED_VALUES, ids=repr)
@pytest.mark.parametrize(("key", "precision"), [("bf16", "bf16"), ("fp16", "fp16")])
def test_a_precision_section_is_on_where_deepspeed_s_own_model_says_it_is(key, precision, value):
    """DeepSpeed's own reading of the section is the measure: its pydantic model, which refuses what it cannot
    read as a bool (memplan then says so in one line)."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from pydantic import ValidationError

    model = DeepSpeedBF16Config if key == "bf16" else DeepSpeedFP16Config
    config = {key: {"enabled": value}}
    try:
        deepspeed_enabled = model(**config[key]).enabled
    except ValidationError:
        with pytest.raises(SettingsError, match=re.escape(f"{key}.enabled is ")):
            file_precision(config)
        return
    expected = precision if deepspeed_enabled and value != "auto" else None
    assert file_precision(config) == expected


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"bf16": True}, 'the DeepSpeed configuration\'s "bf16" is true, where DeepSpeed takes a section such as'),
        ({"torch_autocast": "bfloat16"}, '"torch_autocast" is "bfloat16", where DeepSpeed takes a section'),
        ({"bf16": {"enabled": 2}}, 'bf16.enabled is 2, which DeepSpeed refuses: give true, false or "auto"'),
        (
            {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
            'enables both bf16 and fp16, which DeepSpeed refuses: set "enabled" to false in one of them',
        ),
        ({"torch_autocast": {"enabled": True, "dtype": ["bfloat16"]}}, "and its dtype is ['bfloat16']: give"),
        (  # DeepSpeed would import "t", "o", "r", ... one by one
            {"torch_autocast": {"enabled": False, "lower_precision_safe_modules": "torch.nn.Linear"}},
            'lower_precision_safe_modules is "torch.nn.Linear": give a list of class paths, such as '
            '["torch.nn.Linear"]',
        ),
    ],
)
def test_a_file_deepspeed_would_refuse_is_one_line(config, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        file_precision(config)


def test_values_the_file_gives_that_memplan_s_options_replace():
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "train_batch_size": 256,
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
    }
    assert replaced_values(config, 2, 8, 8, "adamw") == [
        "train_micro_batch_size_per_gpu 4 (-b 2)",
        "train_batch_size 256 (2×8×8 = 128)",
        "optimizer Lamb (--optimizer adamw, handed to DeepSpeed as the client optimizer)",
    ]


@pytest.mark.parametrize(
    "config",
    [
        {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto"},
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8, "train_batch_size": 128},
        {"optimizer": {"type": "AdamW"}},
        {"optimizer": {"type": "Adam"}},  # DeepSpeed's Adam: two float32 moments as torch's AdamW
        {"optimizer": {"params": {"lr": 1e-3}}},  # no type: nothing to replace
    ],
)
def test_values_that_agree_or_are_auto_replace_nothing(config):
    assert replaced_values(config, 2, 8, 8, "adamw") == []


def test_an_adam_file_with_another_optimizer_is_replaced():
    assert replaced_values({"optimizer": {"type": "AdamW"}}, 2, 1, 2, "sgd") == [
        "optimizer AdamW (--optimizer sgd, handed to DeepSpeed as the client optimizer)"
    ]


def _rank(config: dict, **options) -> TrainingSettings:
    options = {"parallel": "zero2", "world_size": 2, "batch_size": 2, **options}
    return TrainingSettings(deepspeed_config=json.dumps(config), **options)


@pytest.mark.parametrize(
    ("config", "precision", "message"),
    [
        (
            {"bf16": {"enabled": True}},
            "fp32",
            "the DeepSpeed configuration enables bf16, and --precision is fp32: give --precision bf16",
        ),
        ({"fp16": {"enabled": True}}, "bf16", "enables fp16, and --precision is bf16: give --precision fp16"),
        (
            {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
            "fp32",
            "enables torch_autocast in bfloat16, and --precision is fp32: give --precision amp-bf16, or change the "
            'file\'s torch_autocast section (its dtype, or "enabled": false) to what the job runs',
        ),
        (
            {"torch_autocast": {"enabled": True, "dtype": "float16"}},
            "amp-bf16",
            "enables torch_autocast in float16, and --precision is amp-bf16: give --precision amp-fp16",
        ),
        (  # torch.autocast's default dtype is the device's: float16 on a GPU, bfloat16 on a CPU
            {"torch_autocast": {"enabled": True}},
            "amp-fp16",
            'enables torch_autocast, and it gives no dtype: give "dtype": "bfloat16" or "float16"',
        ),
        ({"torch_autocast": {"enabled": True, "dtype": "fp32"}}, "fp32", "and its dtype is 'fp32': give"),
        (  # DeepSpeed would run a bf16 model inside autocast; --precision names one of the two
            {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "bf16": {"enabled": True}},
            "amp-bf16",
            'enables both bf16 and torch_autocast, which memplan does not trace together: set "enabled" to false',
        ),
    ],
)
def test_a_file_whose_precision_is_not_precision_s_is_one_line(config, precision, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        _rank(config, precision=precision)


def test_a_file_s_torch_autocast_in_precision_s_dtype_is_taken():
    settings = _rank({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, precision="amp-bf16")
    assert settings.precision == "amp-bf16"


def test_the_note_names_what_was_replaced_and_only_on_a_deepspeed_rank():
    config = {"bf16": {"enabled": True}, "gradient_accumulation_steps": 4}
    notes = settings_notes(_rank(config, precision="bf16", grad_accum=2))
    assert [note for note in notes if "replaced by memplan's options" in note] == [
        "the DeepSpeed configuration's own values replaced by memplan's options (what the Trainer fills for "
        '"auto"): gradient_accumulation_steps 4 (--grad-accum 2)'
    ]
    assert not [note for note in settings_notes(_rank({}, precision="bf16")) if "replaced" in note]


def test_a_sweep_runs_the_file_s_precision_and_refuses_others_in_one_line():
    """--precisions, not --precision's default, is what a sweep runs: a file enabling bf16 sweeps bf16 (it was
    refused as "--precision is fp32"), and a sweep that also names fp32 is refused for fp32."""
    import memplan

    settings = {"parallel": "zero2", "world_size": 2, "seq_len": 32, "device": "cpu"}
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    result = memplan.sweep("tiny-gpt2", deepspeed_config=config, precisions=("bf16",), batch_sizes=(1,), **settings)
    assert [series.precision for series in result.series] == ["bf16"]
    assert result.settings.precision == "bf16"
    with pytest.raises(SettingsError, match=re.escape("enables bf16, and precisions has fp32: sweep bf16 alone")):
        memplan.sweep("tiny-gpt2", deepspeed_config=config, precisions="bf16,fp32", batch_sizes=(1,), **settings)


@pytest.mark.parametrize(("precision", "partition"), [("fp32", "float32"), ("amp-bf16", "float32"), ("bf16", "16-bit")])
def test_the_offload_notes_name_the_model_s_own_dtype(precision, partition):
    """A float32 model's partitions are float32: the notes said "16-bit" whatever the precision."""
    notes = settings_notes(_rank({}, parallel="zero3", offload="params", precision=precision))
    assert any(f"the updated {partition} partition back after the step" in note for note in notes)
    assert any(f"ZeRO-3's {partition} parameter partitions live in host memory" in note for note in notes)


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        ([1], 'zero_optimization is [1], where DeepSpeed takes a section such as {"stage": 2}'),
        ("stage2", 'zero_optimization is "stage2", where DeepSpeed takes a section'),
        ({"stage": 2, "offload_optimizer": "cpu"}, 'offload_optimizer is "cpu", where DeepSpeed takes a section'),
        ({"stage": 3, "offload_param": [1]}, "offload_param is [1], where DeepSpeed takes a section"),
        ({"stage": 2, "offload_optimizer": {"device": "CPU"}}, 'device is "CPU", which DeepSpeed refuses: give "cpu"'),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "half"}}, 'ratio is "half", where DeepSpeed'),
        ({"stage": "two"}, 'stage is "two", which DeepSpeed refuses: give 0, 1, 2 or 3'),
        ({"stage": 4}, "stage is 4, which DeepSpeed refuses"),
        ({"stage": True}, "stage is true, which DeepSpeed refuses"),
    ],
)
def test_a_zero_section_deepspeed_would_refuse_is_one_settings_error(zero, message):
    """They were AttributeErrors and ValueErrors deep in memplan (an internal error, exit 1; from the API not a
    MemplanError)."""
    with pytest.raises(SettingsError) as refused:
        parse_deepspeed_config(json.dumps({"zero_optimization": zero}))
    assert message in str(refused.value)
    config = json.dumps({"zero_optimization": zero})
    with pytest.raises(SettingsError, match="DeepSpeed"):
        TrainingSettings(parallel="zero2", world_size=2, deepspeed_config=config)


@pytest.mark.parametrize("stage", ["2", 2.0, " 2"])
def test_a_stage_deepspeed_reads_as_an_integer_is_that_integer(stage):
    """DeepSpeed's ZeroStageEnum through pydantic's lax mode reads "2" and 2.0 as 2; memplan said '--deepspeed sets
    ZeRO stage 2; --parallel zero2 traces stage 2: memplan traces stages 1 to 3'."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert int(DeepSpeedZeroConfig(stage=stage).stage) == 2
    config = json.dumps({"zero_optimization": {"stage": stage}})
    assert parse_deepspeed_config(config)["zero_optimization"]["stage"] == 2
    assert TrainingSettings(parallel="zero2", world_size=2, deepspeed_config=config).deepspeed_stage == 2
