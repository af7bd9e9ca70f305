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


def test_a_config_without_architectures_builds_where_the_task_has_several_classes(tmp_path):
    """transformers maps DeiT's image classification to two classes (with and without a teacher) and iterates the
    config's `architectures` to choose, which a config.json written without it leaves None: memplan said "internal
    error: TypeError" (a helper's bug hunt). Built, it is the first class, as a real run builds it."""
    import json

    import torch

    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings

    config = {"model_type": "deit", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 64, "image_size": 32}))
    spec = resolve_model(str(tmp_path))
    with torch.device("meta"):
        model = spec.build(spec.settings_for(TrainingSettings(device="cpu")))
    assert type(model).__name__ == "DeiTForImageClassification"


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("bart", "BartForConditionalGeneration"),
        ("t5", "T5ForConditionalGeneration"),
        ("gpt2", "GPT2LMHeadModel"),
        ("bert", "BertForMaskedLM"),
        ("roberta", "RobertaForMaskedLM"),
        ("electra", "ElectraForMaskedLM"),
    ],
)
def test_a_config_without_architectures_builds_the_head_its_kind_trains(tmp_path, model_type, expected):
    """BART, mBART, Pegasus, Marian and Whisper are in transformers' causal-LM mapping too, for their decoder alone
    (BartForCausalLM): a BART config.json without `architectures` had been built as that, with no encoder, and
    `--target-len` refused (a helper's bug hunt). An encoder-decoder config trains both halves."""
    import json

    import torch

    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "decoder_start_token_id": 0}))
    spec = resolve_model(str(tmp_path))
    with torch.device("meta"):
        model = spec.build(spec.settings_for(TrainingSettings(device="cpu")))
    assert type(model).__name__ == expected
    # the answer says which head it trained, and how to pick another
    (note,) = spec.notes
    assert f"trains {expected} (" in note and "--task" in note


def test_an_encoder_config_is_pre_trained_as_a_masked_lm_and_a_decoder_one_as_a_causal_lm(tmp_path):
    """BERT, RoBERTa and ELECTRA are in transformers' causal-LM mapping too (BertLMHeadModel), for their decoder use
    (is_decoder=True): a bare BertModel config (sentence-transformers' all-MiniLM) had been trained as that; its
    is_decoder says which, and a config naming its head gets no note."""
    import json

    from memplan.models.source import resolve_model

    for name, config, expected in (
        ("bare", {"model_type": "bert", "architectures": ["BertModel"]}, "masked-lm"),
        ("decoder", {"model_type": "bert", "is_decoder": True}, "causal-lm"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        (note,) = resolve_model(str(tmp_path / name)).notes
        assert f"({expected})" in note
    (tmp_path / "named").mkdir()
    (tmp_path / "named" / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertLMHeadModel"]})
    )
    assert resolve_model(str(tmp_path / "named")).notes == ()


def test_an_encoder_decoder_config_with_no_head_of_memplan_s_asks_for_one(tmp_path):
    """MusicGen (an encoder-decoder config, in transformers' causal-LM mapping for its decoder alone) has no head of
    memplan's tasks: refused with the way out, not built as its decoder. (Whisper's, here before, is speech-seq2seq
    now: tests/test_models_speech.py.)"""
    import json

    from memplan.models.source import resolve_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "musicgen"}))
    with pytest.raises(UsageError, match="cannot tell which head.*your own module:function"):
        resolve_model(str(tmp_path))


def test_a_config_value_a_module_asserts_against_is_the_config_s_mistake(tmp_path):
    """A pad_token_id past vocab_size fails nn.Embedding's assert: it had said "internal error: AssertionError"."""
    import json

    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings

    config = {"model_type": "llama", "vocab_size": 128, "pad_token_id": 500, "hidden_size": 32}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "num_attention_heads": 2}))
    spec = resolve_model(str(tmp_path))
    with pytest.raises(UsageError, match="Padding_idx must be within num_embeddings.*fix the config"):
        spec.build(spec.settings_for(TrainingSettings(device="cpu")))


def test_a_seq2seq_config_without_a_decoder_start_id_is_refused_saying_which(tmp_path):
    """transformers 5's T5Config() has no decoder_start_token_id, which T5's training forward needs to shift the labels
    right: `memplan estimate t5` said "cannot trace ... AttributeError" (a helper's bug hunt), as the real run fails."""
    import json

    from memplan.models.source import resolve_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32, "num_layers": 1}))
    with pytest.raises(UsageError, match='no decoder_start_token_id.*"decoder_start_token_id": 0'):
        resolve_model(str(tmp_path))
    with pytest.raises(UsageError, match="no decoder_start_token_id"):
        resolve_model("t5")


def test_a_deberta_classifier_is_predicted_as_its_plain_run_measures(tmp_path):
    """DeBERTa(-v2)'s classifiers, with a config leaving `problem_type` unset, pick their labels with
    `(labels >= 0).nonzero()` (modeling_deberta_v2.py), a data-dependent shape: memplan refused every DeBERTa
    classifier (a helper's bug hunt). memplan's labels are class indices, which the other heads read as single-label
    classification; with all of them >= 0 DeBERTa's path runs the same loss. Truth: the library's own model, config
    as written (problem_type unset, its nonzero path), trained plainly and measured by the CPU allocator's events."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings
    from tests.hand_measure import profiled_third_iteration_peak

    config = {"model_type": "deberta-v2", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 64, "vocab_size": 64}))
    batch, seq_len = 2, 8

    def build():
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tmp_path))
        optimizer = torch.optim.AdamW(model.parameters())
        inputs = {"input_ids": torch.randint(0, 64, (batch, seq_len)), "labels": torch.randint(0, 2, (batch,))}

        def iteration():
            model(**inputs).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return iteration

    measured = profiled_third_iteration_peak(build)
    spec = resolve_model(str(tmp_path), task="sequence-classification")
    settings = spec.settings_for(TrainingSettings(batch_size=batch, seq_len=seq_len, device="cpu"))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    # DeBERTa's masked-LM is 8 B high too, with no classifier: a bias of the encoder's, not of this head.
    assert abs(predicted - measured) <= 16


# Run in a fresh interpreter (the test process has transformers.models imported already): the lazy module that
# `import transformers.models` builds, every attribute of it written out in a fixed order (PYTHONHASHSEED fixed: its
# __all__ is a list made from sets), and how many folders transformers scanned for it.
_LAZY_MODELS_MODULE = """
import sys
import transformers
from transformers.utils import import_utils

scans = import_utils.create_import_structure_from_path.cache_info
misses = scans().misses
if sys.argv[1] == "memplan":
    from memplan.models.hf import _load_config

    _load_config("gpt2")
else:  # what _load_config asks transformers for, as transformers does it
    from transformers import AutoConfig

    AutoConfig.for_model("gpt2")
print(scans().misses - misses)
lazy = sys.modules["transformers.models"]


def canonical(value):
    if isinstance(value, dict):
        return sorted((repr(canonical(key)), canonical(item)) for key, item in value.items())
    if isinstance(value, set | frozenset):
        return sorted(repr(canonical(item)) for item in value)
    if isinstance(value, list | tuple):
        return [canonical(item) for item in value]
    return repr(value)


kept = {key: value for key, value in vars(lazy).items() if not key.startswith("__") or key == "__all__"}
print(repr(canonical(kept)))
"""


def _lazy_models_module(how: str) -> tuple[int, str]:
    import os
    import subprocess
    import sys

    environment = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _LAZY_MODELS_MODULE, how], capture_output=True, text=True, env=environment, check=True
    )
    scanned, structure = done.stdout.splitlines()[-2:]
    return int(scanned), structure


def test_transformers_models_is_imported_without_scanning_the_model_folders_again():
    """`import transformers` scans the ~500 folders under transformers/models for their `__all__`; importing
    transformers.models (any config or model class) scanned them all again (~0.5 s of an estimate), its
    __init__.py naming the folder otherwise. memplan asks for it under the first scan's name: the lazy module is
    the one transformers builds itself, every name in the same order, without scanning the folders again."""
    scanned, structure = _lazy_models_module("memplan")
    own_scanned, own_structure = _lazy_models_module("transformers")
    assert own_scanned > 100  # transformers' own import rescans every model folder
    assert scanned < 10, scanned  # the folders of the model it loads (gpt2's __init__.py scans its own)
    assert structure == own_structure


_OTHER_HEADS = {
    # (config.json, the head memplan offers instead with --task, or None)
    # (SegformerForSemanticSegmentation: the semantic-segmentation task, tests/test_models_segmentation.py)
    "dpt-depth-estimation": (
        {"model_type": "dpt", "architectures": ["DPTForDepthEstimation"]},
        "semantic-segmentation (DPTForSemanticSegmentation)",
    ),
    # (Wav2Vec2ForCTC, WhisperForConditionalGeneration: the ctc and speech-seq2seq tasks, tests/test_models_speech.py;
    # CLIPModel, Wav2Vec2ForSequenceClassification: zero-shot-image-classification and audio-classification,
    # tests/test_models_contrastive.py and tests/test_models_audio_classification.py)
}


@pytest.mark.parametrize("case", list(_OTHER_HEADS))
def test_a_config_naming_a_head_memplan_does_not_train_is_refused_saying_so(tmp_path, case):
    """A config naming a head none of memplan's tasks builds had been estimated as another head of its model type:
    SegformerForSemanticSegmentation as Segformer's image classifier, CLIPModel (its contrastive loss over two towers)
    as CLIP's vision tower alone; measured by the CPU allocator's events (tiny configs, batch 2, 32x32 images, AdamW,
    oneDNN off), the named models' steps peak at 363,072 B and 516,664 B, the estimates were 211,120 B and 320,676 B
    (42% and 38% low). WhisperForConditionalGeneration was sent to AutoModelForSeq2SeqLM, which has no Whisper, and
    refused as "fix the config" (a helper's bug hunt). Refused, naming the head and what --task offers instead."""
    import json

    from memplan.models.source import resolve_model

    config, offered = _OTHER_HEADS[case]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError) as refused:
        resolve_model(str(tmp_path))
    said = str(refused.value)
    assert f"names {config['architectures'][0]}, a head none of memplan's tasks builds" in said
    assert "your own module:function" in said
    assert (offered in said) if offered else ("--task" not in said)
    if offered:  # the head offered is estimated when asked for
        task = offered.split()[0]
        assert resolve_model(str(tmp_path), task=task) is not None


def test_an_xlnet_config_with_no_length_limit_resolves(tmp_path):
    """XLNetConfig's max_position_embeddings is a property that returns -1 ("no sequence length limit",
    configuration_xlnet.py): a value the class computes, not a size the file gives, so no reason to refuse every
    XLNet checkpoint as a broken config."""
    import json

    from memplan.models.hf import resolve_hf

    config = {"model_type": "xlnet", "architectures": ["XLNetLMHeadModel"], "d_model": 64, "n_layer": 1, "n_head": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_hf(str(tmp_path), None).task == "causal-lm"
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 0}))
    with pytest.raises(UsageError, match="n_layer"):  # a size the file gives is still checked
        resolve_hf(str(tmp_path), None)
