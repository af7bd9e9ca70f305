"""Two-tower image-text models trained on their own contrastive loss: the `zero-shot-image-classification` task.

AutoModelForZeroShotImageClassification (transformers' MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES)
builds CLIPModel, SiglipModel and their kin; called with `return_loss=True`, as transformers' contrastive-image-text
example's collator passes it (examples/pytorch/contrastive-image-text/run_clip.py, `collate_fn`), the forward
computes the loss over the batch's image-text pairs itself: CLIP's symmetric cross entropy over the similarity
matrix (`clip_loss`), SigLIP's sigmoid loss (SiglipModel.forward). The batch: `input_ids` [batch, --seq-len] for the
text tower, `pixel_values` [batch, channels, --image-size, --image-size] for the vision tower, `return_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.settings import TrainingSettings

CONTRASTIVE_TASK = "zero-shot-image-classification"
DEFAULT_TEXT_LEN = 77  # CLIP's text positions, what its tokenizer pads captions to (padding="max_length")


@dataclass(frozen=True)
class TwoTowerFamily:
    """One model type's towers: `source`, the transformers file whose <Family>Model.forward takes the batch and
    computes the loss; `embeddings`, its vision embeddings class, whose position table is sized for the config's
    image_size (another size fails without `interpolate_pos_encoding`, which the training forward leaves off)."""

    source: str
    embeddings: str


# transformers/models/<family>/modeling_<family>.py, 5.17-5.25: <Family>Model.forward(input_ids, pixel_values,
# return_loss). CLIPVisionEmbeddings raises "Input image size (...) doesn't match model" for another image size;
# SiglipVisionEmbeddings adds its position table of the config's patches (a shape mismatch).
FAMILIES: dict[str, TwoTowerFamily] = {
    "clip": TwoTowerFamily("clip/modeling_clip.py (CLIPModel.forward, clip_loss)", "CLIPVisionEmbeddings"),
    "metaclip_2": TwoTowerFamily(
        "metaclip_2/modeling_metaclip_2.py (MetaClip2Model.forward, clip_loss)", "MetaClip2VisionEmbeddings"
    ),
    "siglip": TwoTowerFamily("siglip/modeling_siglip.py (SiglipModel.forward, sigmoid loss)", "SiglipVisionEmbeddings"),
}
# Types in the mapping whose batch is not (input_ids, pixel_values): why, in one line each.
_OTHER_BATCHES = {
    "siglip2": (
        "Siglip2Model takes patches with their `spatial_shapes`, whose values size the resized position embeddings "
        "(Siglip2VisionEmbeddings.resize_positional_embeddings: F.interpolate to each image's height and width), "
        "which a trace without values cannot know"
    ),
}


def family(config: Any) -> TwoTowerFamily:
    """The model type's row, or one line naming the types memplan makes batches for."""
    row = FAMILIES.get(config.model_type)
    if row is None:
        why = _OTHER_BATCHES.get(config.model_type, f"{config.model_type}'s forward is not one memplan has checked")
        raise SettingsError(
            f"memplan makes {CONTRASTIVE_TASK} batches for {', '.join(FAMILIES)}, not {config.model_type}: {why}; "
            "give the model, its batch and loss as your own module:function (docs/usage.md)"
        )
    return row


def text_limit(config: Any) -> int | None:
    """The longest --seq-len the text tower's position embeddings allow (its max_position_embeddings)."""
    value = getattr(getattr(config, "text_config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _image_size(config: Any) -> int | None:
    size = getattr(getattr(config, "vision_config", None), "image_size", None)
    if isinstance(size, list | tuple) and size:
        size = size[0]
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def resolve_contrastive_lengths(config: Any, settings: TrainingSettings) -> TrainingSettings:
    """--seq-len (the captions' tokens: default min(77, the text tower's limit), refused past it) and --image-size
    (the vision tower's image_size, the only one its position embeddings take)."""
    row = family(config)
    if settings.target_len is not None:
        raise SettingsError(
            f"--target-len has no place in a {CONTRASTIVE_TASK} model's batch, which takes --seq-len (caption "
            "tokens) and --image-size: drop --target-len"
        )
    limit = text_limit(config)
    seq_len = settings.seq_len or (min(DEFAULT_TEXT_LEN, limit) if limit else DEFAULT_TEXT_LEN)
    if limit is not None and seq_len > limit:
        raise SettingsError(
            f"--seq-len {seq_len} is longer than {config.model_type}'s text tower takes, {limit} positions "
            f"(text_config.max_position_embeddings); use --seq-len {limit} or less"
        )
    configured = _image_size(config)
    image_size = settings.image_size or configured
    if image_size is None:
        raise SettingsError(f"{config.model_type}'s vision_config names no image_size: give --image-size")
    if configured is not None and image_size != configured:
        raise SettingsError(
            f"--image-size {image_size}: {config.model_type}'s vision tower takes {configured}x{configured} images "
            f"(its position embeddings are sized for them, {row.embeddings}): give --image-size {configured} or "
            "leave it out"
        )
    return settings.replace(seq_len=seq_len, image_size=int(image_size))


def contrastive_batch(config: Any, settings: TrainingSettings, dtype: torch.dtype) -> dict[str, Any]:
    """Captions of --seq-len tokens and their images, and `return_loss` (run_clip.py's collate_fn)."""
    family(config)
    batch, size = settings.batch_size, settings.image_size
    channels = getattr(config.vision_config, "num_channels", 3)
    return {
        "input_ids": torch.randint(0, config.text_config.vocab_size, (batch, settings.seq_len)),
        "pixel_values": torch.randn(batch, channels, size, size, dtype=dtype),
        "return_loss": True,
    }
