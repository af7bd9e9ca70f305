"""memplan.models.batches: the image size a batch gets where the user gives none."""

from types import SimpleNamespace

import pytest

from memplan.models.batches import DEFAULT_IMAGE_SIZE, resolve_lengths
from memplan.settings import TrainingSettings


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SimpleNamespace(image_size=64), 64),
        # CLIP's and SigLIP's configs keep it in their vision tower's: memplan had taken 224 and then refused it
        # with "give --image-size 32 or leave it out", where it was left out (a helper's bug hunt)
        (SimpleNamespace(vision_config=SimpleNamespace(image_size=32)), 32),
        (SimpleNamespace(image_size=[48, 48]), 48),
        (SimpleNamespace(), DEFAULT_IMAGE_SIZE),
    ],
)
def test_an_image_models_batch_takes_the_size_its_config_names(config, expected):
    settings = resolve_lengths(config, "image-classification", TrainingSettings(batch_size=2))
    assert settings.image_size == expected
    given = resolve_lengths(config, "image-classification", TrainingSettings(batch_size=2, image_size=96))
    assert given.image_size == 96


def _text_config(**fields):
    return SimpleNamespace(model_type="bart", **fields)


@pytest.mark.parametrize(
    ("config", "task", "settings", "refusal"),
    [
        # BART's one limit holds for the decoder too: a target past it traced (fake tensors index without values)
        # while the real run died with "IndexError: index out of range in self" (a helper's bug hunt).
        (_text_config(max_position_embeddings=128), "seq2seq", {"seq_len": 32, "target_len": 200}, "--target-len 200"),
        (_text_config(max_position_embeddings=128), "seq2seq", {"seq_len": 200}, "--seq-len 200"),
        # Whisper keeps its decoder's limit in max_target_positions, which had not been read at all.
        (_text_config(max_target_positions=64), "causal-lm", {"seq_len": 100}, "--seq-len 100"),
        (_text_config(max_target_positions=64, max_source_positions=1500), "seq2seq", {"seq_len": 100}, "target"),
        # LED's split fields.
        (
            _text_config(max_encoder_position_embeddings=64, max_decoder_position_embeddings=32),
            "seq2seq",
            {"seq_len": 64, "target_len": 48},
            "--target-len 48",
        ),
    ],
)
def test_a_length_past_the_model_s_positions_is_refused(config, task, settings, refusal):
    from memplan.errors import SettingsError

    with pytest.raises(SettingsError, match=refusal):
        resolve_lengths(config, task, TrainingSettings(**settings))


def test_lengths_within_each_side_s_positions_are_taken():
    config = _text_config(max_encoder_position_embeddings=64, max_decoder_position_embeddings=32)
    resolved = resolve_lengths(config, "seq2seq", TrainingSettings(seq_len=64, target_len=32))
    assert (resolved.seq_len, resolved.target_len) == (64, 32)
