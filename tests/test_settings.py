import pytest

from memplan.errors import SettingsError, SizeParseError
from memplan.settings import TrainingSettings, format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("24GiB", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("1048576", 2**20),
        ("4kb", 4000),
        (12345, 12345),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-3GB", "0", "1e9", "0.1B"])
def test_parse_size_rejects(text):
    with pytest.raises(SizeParseError):
        parse_size(text)


def test_format_bytes_uses_binary_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(2**20) == "1.00 MiB"


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
