"""The configuration memplan hands DeepSpeed's engine (memplan.distributed.deepspeed_config): the user's file with
memplan's own settings in place, and "auto" sizes filled as transformers fills them."""

from __future__ import annotations

from memplan.distributed.deepspeed_config import deepspeed_config


def test_transformers_auto_sizes_for_stage_3_are_filled_as_it_fills_them():
    """transformers fills stage 3's "auto" prefetch bucket and persistence threshold from the hidden size
    (int(0.9 × hidden²) and 10 × hidden, integrations/deepspeed.py) and DeepSpeed's defaults serve for
    the stage-3 keys that size no buffer."""
    user = {
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": "auto",
        }
    }
    config = deepspeed_config(3, 1, "bf16", user, hidden_size=1000)
    assert config["zero_optimization"] == {
        "stage": 3,
        "stage3_prefetch_bucket_size": 900_000,
        "stage3_param_persistence_threshold": 10_000,
    }
    assert deepspeed_config(2, 1, "bf16", user, hidden_size=1000)["zero_optimization"] == {"stage": 2}


def test_the_engines_configuration_is_the_users_with_memplans_settings():
    """What the rank's engine is built with: the user's zero_optimization, "auto" bucket sizes as
    transformers fills them (hidden_size², integrations/deepspeed.py), and memplan's batch,
    accumulation and precision in place of the user's."""
    user = {
        "train_batch_size": 512,
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True},
    }
    config = deepspeed_config(2, 8, "bf16", user, hidden_size=768)
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 768 * 768, "overlap_comm": True}
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["gradient_accumulation_steps"] == 1
    assert deepspeed_config(2, 8, "bf16", user, 768, grad_accum=4)["gradient_accumulation_steps"] == 4
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert deepspeed_config(2, 8, "fp16", user, 768)["fp16"] == {"enabled": True}
    assert "torch_autocast" not in config
    # amp-bf16, amp-fp16: DeepSpeed's torch_autocast in that dtype, the user's lower-precision module list kept
    with_modules = {**user, "torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["a.B"]}}
    autocast = deepspeed_config(2, 8, "amp-fp16", with_modules, 768)
    assert autocast["torch_autocast"] == {"enabled": True, "dtype": "float16", "lower_precision_safe_modules": ["a.B"]}
    assert autocast["bf16"] == autocast["fp16"] == {"enabled": False}
    assert deepspeed_config(2, 8, "amp-bf16", user, 768)["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert "optimizer" not in config and "train_batch_size" not in config


def test_deprecated_offload_switches_are_the_sections_deepspeed_makes_of_them():
    """`cpu_offload` and `cpu_offload_param` still offload in DeepSpeed 0.19 (DeepSpeedZeroConfig's new_param_fn):
    memplan's validator had counted such a rank's host memory as the device's (2× the prediction) and, without
    `zero_force_ds_cpu_optimizer: false`, handed DeepSpeed an optimizer it refused ("internal error"). Truth:
    DeepSpeed's own reading of the same section."""
    import pytest
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from memplan.distributed.deepspeed_file import with_zero_section_read
    from memplan.errors import SettingsError

    for zero in (
        {"stage": 3, "cpu_offload": True, "cpu_offload_param": True},
        {"stage": 2, "cpu_offload": True},
        {"stage": 2, "cpu_offload": False},
        {"stage": 2, "cpu_offload": None},  # values DeepSpeed's Optional[bool] field reads too
        {"stage": 2, "cpu_offload": 1},
        {"stage": 3, "cpu_offload_param": "true"},
    ):
        ours = with_zero_section_read({"zero_optimization": zero})["zero_optimization"]
        theirs = DeepSpeedZeroConfig(**zero)
        for section in ("offload_optimizer", "offload_param"):
            device = getattr(theirs, section).device if getattr(theirs, section) is not None else None
            assert (ours.get(section) or {}).get("device") == device, (zero, section)
        assert not {"cpu_offload", "cpu_offload_param"} & set(ours)
    both = {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(AssertionError):
        DeepSpeedZeroConfig(**both)
    with pytest.raises(SettingsError, match="together, which DeepSpeed refuses"):
        with_zero_section_read({"zero_optimization": both})
