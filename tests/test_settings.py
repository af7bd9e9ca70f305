import pytest

from memplan.errors import SettingsError
from memplan.settings import TrainingSettings


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"batch_size": -4},
        {"grad_accum": 0},
        {"seq_len": 0},
        {"precision": "fp8"},
        {"optimizer": "lion"},
        {"device": "tpu"},
        {"checkpoint": "some"},
        {"optimizer": "adafactor", "optimizer_impl": "fused"},
        {"cudnn_workspace_cap_mib": -1},
        {"cudnn_workspace_cap_mib": True},
        {"cublas_workspace_config": "4096:8"},
        {"device": "cpu", "cudnn_benchmark": True},
        {"device": "cpu", "cudnn_allow_tf32": False},
        {"device": "cpu", "cublas_workspace_config": ":16:8"},
    ],
)
def test_settings_reject_invalid(kwargs):
    with pytest.raises(SettingsError):
        TrainingSettings(**kwargs)


def test_settings_replace_validates_and_round_trips():
    settings = TrainingSettings(batch_size=4, precision="amp-bf16")
    assert settings.is_amp
    assert settings.replace(batch_size=8).to_dict()["batch_size"] == 8
    with pytest.raises(SettingsError):
        settings.replace(batch_size=0)


@pytest.mark.parametrize(
    ("parallel", "zero_optimization", "given", "offload"),
    [
        ("zero2", {"offload_optimizer": {"device": "cpu"}}, "none", "optimizer"),
        ("zero3", {"offload_optimizer": {"device": "cpu"}}, "none", "optimizer"),
        ("zero3", {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "none", "params"),
        ("zero3", {"offload_optimizer": {"device": "none"}}, "none", "none"),
        ("zero2", {}, "none", "none"),
        # --offload adds to the file: the optimizer by the flag and the parameters by the file is ZeRO-3's both
        ("zero3", {"offload_param": {"device": "cpu"}}, "optimizer", "params"),
        ("zero3", {"offload_optimizer": {"device": "cpu"}}, "params", "params"),
        ("zero2", {}, "optimizer", "optimizer"),
    ],
)
def test_settings_say_what_a_deepspeed_rank_offloads(parallel, zero_optimization, given, offload):
    """The settings (the JSON's `settings.offload`) name what the rank offloads, by --offload or by the --deepspeed
    file's own sections, as --offload would name it, and read back to the same settings."""
    import json

    config = json.dumps({"zero_optimization": zero_optimization})
    settings = TrainingSettings(parallel=parallel, world_size=4, deepspeed_config=config, offload=given)
    assert settings.offload == offload
    assert TrainingSettings.from_dict(settings.to_dict()) == settings


def test_a_deepspeed_file_offloading_parameters_alone_is_still_refused():
    """offload_param without offload_optimizer is not what --offload params means (that moves both): it is left to
    the configuration's own check, not turned into --offload params."""
    from memplan.distributed.deepspeed_config import deepspeed_config

    config = '{"zero_optimization": {"offload_param": {"device": "cpu"}}}'
    settings = TrainingSettings(parallel="zero3", world_size=4, deepspeed_config=config)
    assert settings.offload == "none"
    with pytest.raises(SettingsError, match="offload_param without offload_optimizer"):
        deepspeed_config(3, 1, "fp32", settings.deepspeed_settings, 64, 1, settings.offload)


def test_a_misspelt_setting_is_a_settings_error_naming_the_known_ones():
    """memplan.TrainingSettings(bogus=1) had raised the dataclass's bare TypeError (API bug hunt)."""
    import pytest

    from memplan.errors import SettingsError
    from memplan.settings import TrainingSettings

    with pytest.raises(SettingsError, match="unknown setting\\(s\\) batchsize; known: batch_size"):
        TrainingSettings(batchsize=4)
