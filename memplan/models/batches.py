"""Synthesize the training batch a task head expects, in whatever tensor mode is active."""

from __future__ import annotations

from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.models.contrastive import CONTRASTIVE_TASK, contrastive_batch, resolve_contrastive_lengths, text_limit
from memplan.models.segmentation import SEGMENTATION_TASK, check_segmentation, segmentation_batch
from memplan.models.speech import SPEECH_TASKS, input_limit, resolve_speech_lengths, speech_batch
from memplan.models.text_heads import TEXT_HEAD_TASKS, check_text_head, text_head_batch
from memplan.models.vision_language import (
    VISION_LANGUAGE_TASK,
    resolve_vision_language_lengths,
    vision_language_batch,
)
from memplan.settings import TrainingSettings

TASKS = (
    "causal-lm",
    "masked-lm",
    "sequence-classification",
    "seq2seq",
    "image-classification",
    SEGMENTATION_TASK,
    *SPEECH_TASKS,
    CONTRASTIVE_TASK,
    *TEXT_HEAD_TASKS,
    VISION_LANGUAGE_TASK,
)
IMAGE_TASKS = ("image-classification", SEGMENTATION_TASK)
TEXT_TASKS = ("causal-lm", "masked-lm", "sequence-classification", "seq2seq", *TEXT_HEAD_TASKS)
DEFAULT_SEQ_LEN = 512
DEFAULT_IMAGE_SIZE = 224


# Where configs keep the longest sequence their absolute position embeddings allow, per side, most specific first:
# LED's split fields; Whisper's and Speech2Text's source (encoder) and target (decoder) fields; one limit for both
# sides (BART, GPT-2's n_positions, MPT's max_seq_len).
_POSITION_FIELDS = {
    "encoder": ("max_encoder_position_embeddings", "max_source_positions"),
    "decoder": ("max_decoder_position_embeddings", "max_target_positions"),
}
_SHARED_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len")


def max_positions(config: Any, side: str = "encoder") -> int | None:
    """The longest sequence the model's absolute position embeddings allow on `side` ("encoder": the input a
    seq2seq model encodes, or an encoder-only model's; "decoder": a causal LM's, or a seq2seq model's target);
    None: no limit known."""
    if getattr(config, "model_type", None) == "t5":
        return None  # relative position buckets: any length
    for attr in (*_POSITION_FIELDS[side], *_SHARED_POSITION_FIELDS):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def sequence_limit(config: Any, task: str) -> int | None:
    """The longest --seq-len the task's model takes (seq2seq: its target, as long as the input unless given, too)."""
    if task in SPEECH_TASKS:
        return input_limit(config, task)  # input frames (Whisper: the one length it takes) or samples (ctc: none)
    if task == CONTRASTIVE_TASK:
        return text_limit(config)  # the captions' tokens
    if task == VISION_LANGUAGE_TASK:
        return max_positions(config.text_config, "decoder")  # all the tokens, the image's placeholders included
    if task == "causal-lm":
        return max_positions(config, "decoder")
    if task == "seq2seq":
        limits = [limit for limit in (max_positions(config), max_positions(config, "decoder")) if limit is not None]
        return min(limits) if limits else None
    return max_positions(config)


def resolve_lengths(config: Any, task: str, settings: TrainingSettings) -> TrainingSettings:
    """Fill in the sequence length / image size the batch will have and check it against the model."""
    if task in SPEECH_TASKS:
        return resolve_speech_lengths(config, task, settings)
    if task == CONTRASTIVE_TASK:
        return resolve_contrastive_lengths(config, settings)
    if task == VISION_LANGUAGE_TASK:
        return resolve_vision_language_lengths(config, settings)
    _refuse_other_shapes(task, settings)
    if task in TEXT_HEAD_TASKS:
        check_text_head(config, task)
    if task in TEXT_TASKS:
        limit = max_positions(config, "decoder" if task == "causal-lm" else "encoder")
        seq_len = settings.seq_len or (min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN)
        if limit is not None and seq_len > limit:
            raise SettingsError(
                f"--seq-len {seq_len} is longer than the model's maximum of {limit} positions; "
                f"use --seq-len {limit} or less"
            )
        target_len = settings.target_len or (seq_len if task == "seq2seq" else None)
        target_limit = max_positions(config, "decoder") if task == "seq2seq" else None
        if target_len is not None and target_limit is not None and target_len > target_limit:
            # Fake tensors index without values: a target past the decoder's positions traces, and the real run dies.
            given = "--target-len" if settings.target_len else "the target (as long as --seq-len)"
            raise SettingsError(
                f"{given} {target_len} is longer than the model's decoder maximum of {target_limit} positions; "
                f"use --target-len {target_limit} or less"
            )
        return settings.replace(seq_len=seq_len, target_len=target_len)
    if task == SEGMENTATION_TASK:
        check_segmentation(config)
    image_size = settings.image_size or _configured_image_size(config) or DEFAULT_IMAGE_SIZE
    return settings.replace(image_size=int(image_size))


def _configured_image_size(config: Any) -> int | None:
    """The image size the config names: its own, or its vision tower's (CLIP, SigLIP and other two-tower
    configs keep it in `vision_config`, where the position embeddings are sized by it), or its backbone's (UperNet
    builds its backbone from `backbone_config`)."""
    for source in (config, getattr(config, "vision_config", None), getattr(config, "backbone_config", None)):
        size = getattr(source, "image_size", None)
        if isinstance(size, list | tuple) and size:  # (height, width): the batch is square
            size = size[0]
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


def _refuse_other_shapes(task: str, settings: TrainingSettings) -> None:
    """A length the task's batch has no place for is a mistake to say, not a flag to ignore."""
    unused = {
        "--image-size": settings.image_size if task in TEXT_TASKS else None,
        "--seq-len": settings.seq_len if task not in TEXT_TASKS else None,
        "--target-len": settings.target_len if task != "seq2seq" else None,
    }
    given = [flag for flag, value in unused.items() if value is not None]
    if given:
        takes = {
            "seq2seq": "--seq-len and --target-len",
            "image-classification": "--image-size",
            SEGMENTATION_TASK: "--image-size",
        }.get(task, "--seq-len")
        raise SettingsError(
            f"{', '.join(given)} has no place in a {task} model's batch, which takes {takes}: drop {', '.join(given)}"
        )


def synthesize_batch(config: Any, task: str, settings: TrainingSettings, dtype: torch.dtype) -> dict[str, Any]:
    """Full-length, unpadded batches (no attention mask), labels as a data collator makes them."""
    if task in SPEECH_TASKS:
        return speech_batch(config, task, settings, dtype)
    if task == CONTRASTIVE_TASK:
        return contrastive_batch(config, settings, dtype)
    if task in TEXT_HEAD_TASKS:
        return text_head_batch(config, task, settings)
    if task == VISION_LANGUAGE_TASK:
        return vision_language_batch(config, settings, dtype)
    batch = settings.batch_size
    vocab = getattr(config, "vocab_size", 2)
    if task in ("causal-lm", "masked-lm"):
        input_ids = torch.randint(0, vocab, (batch, settings.seq_len))
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    if task == "sequence-classification":
        return {
            "input_ids": torch.randint(0, vocab, (batch, settings.seq_len)),
            "labels": torch.randint(0, config.num_labels, (batch,)),
        }
    if task == "seq2seq":
        return {
            "input_ids": torch.randint(0, vocab, (batch, settings.seq_len)),
            "labels": torch.randint(0, vocab, (batch, settings.target_len)),
        }
    if task == SEGMENTATION_TASK:
        return segmentation_batch(config, settings, dtype)
    if task == "image-classification":
        channels = getattr(config, "num_channels", 3)
        size = settings.image_size
        return {
            "pixel_values": torch.randn(batch, channels, size, size, dtype=dtype),
            "labels": torch.randint(0, config.num_labels, (batch,)),
        }
    raise AssertionError(f"unknown task {task}")
