"""The shipped presets are the models they name: each config, built by transformers on the meta
device (memplan's tracer not involved), has the parameter count the model's own hub page lists
(the total of its safetensors files, e.g. Llama-3.1-8B's 16,060,522,496 bytes of bf16 = 8,030,261,248
parameters). A wrong width, head count, vocabulary or tie setting in a preset changes that count."""

from __future__ import annotations

import pytest
import torch

from memplan.models.presets import all_presets, preset_for_hub_id

PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "phi-3.5-mini": 3_821_079_552,
    "mistral-nemo-12b": 12_247_782_400,
    "smollm2-1.7b": 1_711_376_384,
    "vit-large-patch16-224": 304_326_632,
    # The hub page says 46.7B; by hand: 32 layers × (attention 41,943,040 + 8 experts × 3 × 4096 × 14336 + router
    # 32,768 + norms 8,192) + embeddings and LM head 2 × 131,072,000 + final norm 4,096.
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED_PARAMETERS.items()))
def test_a_presets_config_has_its_models_parameter_count(name, published):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification

    preset = all_presets()[name]
    config = AutoConfig.for_model(preset.model_type, **preset.config)
    kind = AutoModelForImageClassification if preset.task == "image-classification" else AutoModelForCausalLM
    with torch.device("meta"):
        model = kind.from_config(config)
    assert sum(param.numel() for param in model.parameters()) == published


def test_a_hub_id_not_in_the_cache_resolves_to_its_preset_offline():
    from memplan.models.hf import resolve_hf

    assert preset_for_hub_id("META-LLAMA/Llama-3.1-8B").name == "llama-3.1-8b"
    source = resolve_hf("meta-llama/Llama-3.2-1B", None)  # no hub cache on this machine
    assert source is not None and source.task == "causal-lm"
    shapes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    preset = all_presets()["llama-3.2-1b"].config
    assert [getattr(source.config, key) for key in shapes] == [preset[key] for key in shapes]


def test_every_preset_written_as_a_config_json_loads_with_its_own_sizes(tmp_path):
    """memplan refuses a config.json key that is a near miss of a field left at its default (memplan.models.hf,
    `n_layers` for GPT-2's `n_layer`): no preset's own fields, written as a user would or as transformers saves
    them (every field, `architectures` and `transformers_version` with them), may be refused or lose a size."""
    import json

    from transformers import AutoConfig

    from memplan.models.hf import _local_config
    from memplan.models.presets import all_presets

    for name, preset in all_presets().items():
        built = AutoConfig.for_model(preset.model_type, **preset.config)
        saved = json.loads(built.to_json_string())
        for form, data in (("written", {"model_type": preset.model_type, **preset.config}), ("saved", saved)):
            path = tmp_path / f"{name}-{form}.json"
            path.write_text(json.dumps(data))
            config = _local_config(str(path))
            where = {"transformers_version": None, "_name_or_path": None}  # what says where the file came from
            assert config.to_dict() | where == built.to_dict() | where, (name, form)


def test_a_config_class_that_needs_arguments_skips_the_near_miss_check():
    """The check builds the class's defaults to find fields left at them; nougat's config cannot be built without
    arguments, and its ValueError came out of memplan as an internal error."""
    from transformers import CONFIG_MAPPING

    from memplan.models.hf import _check_fields

    nougat = CONFIG_MAPPING["nougat"]
    with pytest.raises(ValueError):
        nougat()
    _check_fields({"model_type": "nougat", "n_layers": 2}, nougat, "config.json")  # nothing to compare with: no error
