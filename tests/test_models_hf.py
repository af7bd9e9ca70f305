"""memplan.models.hf: a config.json key transformers would keep as a stray attribute is refused; a field is not."""

import pytest

from memplan.errors import UsageError
from memplan.models.hf import _check_fields


def test_a_property_of_the_config_class_is_a_field():
    """`num_labels` is PretrainedConfig's (a property that sets id2label): a Swin config with it had been refused as a
    near miss of num_layers (a helper's bug hunt)."""
    from transformers import SwinConfig

    _check_fields({"model_type": "swin", "embed_dim": 16, "num_labels": 5}, SwinConfig, "config.json")


def test_a_near_miss_of_a_field_left_at_its_default_is_still_refused():
    from transformers import GPT2Config

    with pytest.raises(UsageError, match="'n_layers' is not a field of transformers' GPT2Config"):
        _check_fields({"model_type": "gpt2", "n_layers": 2}, GPT2Config, "config.json")
