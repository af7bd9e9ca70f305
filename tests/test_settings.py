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
