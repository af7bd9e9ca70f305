"""The API's arguments as the functions receive them (memplan.api_arguments)."""

import pytest

from memplan.api_arguments import budget_in_bytes
from memplan.errors import SettingsError
from memplan.settings import TrainingSettings


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (24e9, 24 * 10**9),  # a float as Python writes large numbers
        (1e16, 10**16),  # str(1e16) is '1e+16', which no size parser reads
        (float(3 << 30), 3 << 30),
        (512, 512),
        ("24GiB", 24 << 30),
    ],
)
def test_a_budget_in_bytes_is_taken_whole(budget, expected):
    assert budget_in_bytes(budget, TrainingSettings()) == expected


@pytest.mark.parametrize("budget", [1.5, 24e9 + 0.5, float("nan"), float("inf")])
def test_a_budget_that_is_no_whole_number_of_bytes_is_refused(budget):
    with pytest.raises(SettingsError):
        budget_in_bytes(budget, TrainingSettings())


def test_a_deepspeed_configuration_may_be_its_file_as_the_cli_takes_it(tmp_path):
    import json
    from pathlib import Path

    import memplan

    example = Path(__file__).resolve().parents[1] / "examples" / "ds_config_zero2.json"
    common = {"seq_len": 16, "device": "cpu", "parallel": "zero2", "world_size": 2, "batch_size": 2}
    as_dict = memplan.estimate("tiny-llama", deepspeed_config=json.loads(example.read_text()), **common)
    for given in (str(example), example):
        from_file = memplan.estimate("tiny-llama", deepspeed_config=given, **common)
        assert from_file.settings.deepspeed_config == as_dict.settings.deepspeed_config
        assert from_file.peak_bytes == as_dict.peak_bytes
    with pytest.raises(SettingsError, match="is neither a DeepSpeed configuration .* nor a file memplan can read"):
        memplan.estimate("tiny-llama", deepspeed_config=str(tmp_path / "missing.json"), **common)
