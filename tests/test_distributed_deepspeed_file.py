"""What a DeepSpeed configuration says about memplan's own settings (memplan.distributed.deepspeed_file): the
precision it enables outright must be --precision's, and the batch, accumulation and optimizer it gives are
replaced by memplan's options, said so in a note."""

from __future__ import annotations

import json
import re

import pytest

from memplan.distributed.deepspeed_file import file_precision, replaced_values
from memplan.errors import SettingsError
from memplan.estimator.estimate import _notes
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
        ({"torch_autocast": {"enabled": "auto", "dtype": "float16"}}, None),
        ({"bf16": {"enabled": "auto"}}, None),  # the Trainer's to fill
        ({"bf16": {"enabled": False}, "fp16": {"enabled": False}}, None),
        ({"zero_optimization": {"stage": 2}}, None),
    ],
)
def test_the_precision_a_file_enables(config, precision):
    assert file_precision(config) == precision


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
    notes = _notes(_rank(config, precision="bf16", grad_accum=2))
    assert [note for note in notes if "replaced by memplan's options" in note] == [
        "the DeepSpeed configuration's own values replaced by memplan's options (what the Trainer fills for "
        '"auto"): gradient_accumulation_steps 4 (--grad-accum 2)'
    ]
    assert not [note for note in _notes(_rank({}, precision="bf16")) if "replaced" in note]
