"""Semantic segmentation heads' training batches: what each family's forward takes, and the labels it refuses.

One task, `semantic-segmentation` (AutoModelForSemanticSegmentation), one row per model type (transformers 5.17-5.25
sources cited per row). The batch is what a segmentation collator hands the model (an ADE20k-style image processor's
`pixel_values` and `labels`): images [batch, num_channels, size, size] and a class id per pixel, labels
[batch, size, size] (int64) in [0, num_labels). --image-size is the side, as for image classification (the config's
`image_size`, its backbone's, or 224).

Each head upsamples its logits bilinearly to the labels' size (UperNet: to the image's, the same here) and takes the
cross entropy with the config's ignore index (255 where unset): `nn.CrossEntropyLoss(ignore_index=...)` or
transformers' ForSemanticSegmentationLoss (transformers/loss/loss_utils.py). The ignored pixels' values change no
tensor's size, so the labels are all valid ids. Heads with an auxiliary head (BEiT, Data2Vec-vision, DPT, UperNet
with `use_auxiliary_head`) take a second upsampled cross entropy over the auxiliary logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.settings import TrainingSettings

SEGMENTATION_TASK = "semantic-segmentation"


@dataclass(frozen=True)
class SegmentationFamily:
    """How one model type's segmentation head trains.

    `binary`: the head takes num_labels == 1 (a binary mask, BCE with logits over the valid pixels) where the others
    raise "The number of labels should be greater than one". `source`: where transformers says so.
    """

    source: str
    binary: bool = False


# transformers/models/<family>/modeling_<family>.py, <Family>ForSemanticSegmentation.forward, 5.17-5.25.
FAMILIES: dict[str, SegmentationFamily] = {
    # num_labels > 1: CrossEntropyLoss(ignore_index=semantic_loss_ignore_index) over logits upsampled to the labels;
    # num_labels == 1: BCEWithLogitsLoss(reduction="none") times the valid pixels' mask, averaged.
    "segformer": SegmentationFamily("segformer/modeling_segformer.py, SegformerForSemanticSegmentation", binary=True),
    # ForSemanticSegmentationLoss (5.25; 5.17 computes the same inline), main and auxiliary (FCN) heads.
    "beit": SegmentationFamily("beit/modeling_beit.py, BeitForSemanticSegmentation"),
    "data2vec-vision": SegmentationFamily(
        "data2vec/modeling_data2vec_vision.py, Data2VecVisionForSemanticSegmentation"
    ),
    "dpt": SegmentationFamily("dpt/modeling_dpt.py, DPTForSemanticSegmentation"),
    # DeepLabV3 heads (ASPP) over the MobileNet / MobileViT backbones.
    "mobilenet_v2": SegmentationFamily("mobilenet_v2/modeling_mobilenet_v2.py, MobileNetV2ForSemanticSegmentation"),
    "mobilevit": SegmentationFamily("mobilevit/modeling_mobilevit.py, MobileViTForSemanticSegmentation"),
    "mobilevitv2": SegmentationFamily("mobilevitv2/modeling_mobilevitv2.py, MobileViTV2ForSemanticSegmentation"),
    # UperNet over any backbone its backbone_config names (ConvNeXt, Swin, ResNet): logits upsampled to the image,
    # CrossEntropyLoss(ignore_index=loss_ignore_index).
    "upernet": SegmentationFamily("upernet/modeling_upernet.py, UperNetForSemanticSegmentation"),
}


def family(config: Any) -> SegmentationFamily:
    """The model type's row, or one line naming the ones memplan makes batches for."""
    row = FAMILIES.get(config.model_type)
    if row is None:
        raise SettingsError(
            f"memplan makes {SEGMENTATION_TASK} batches for {', '.join(FAMILIES)}, not {config.model_type}: give the "
            "model, its batch and loss as your own module:function (docs/usage.md)"
        )
    return row


def check_segmentation(config: Any) -> None:
    """A head that raises on its labels, refused before the trace in one line."""
    row = family(config)
    if config.num_labels == 1 and not row.binary:
        raise SettingsError(
            f"{config.model_type}'s segmentation head trains with 2 or more labels (num_labels 1 raises \"The number "
            f'of labels should be greater than one", {row.source}): set num_labels (or id2label) in the config'
        )


def segmentation_batch(config: Any, settings: TrainingSettings, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Images and a class id per pixel, as a segmentation collator hands them (labels int64, the image's size)."""
    channels = getattr(config, "num_channels", None) or getattr(
        getattr(config, "backbone_config", None), "num_channels", 3
    )
    batch, size = settings.batch_size, settings.image_size
    return {
        "pixel_values": torch.randn(batch, channels, size, size, dtype=dtype),
        "labels": torch.randint(0, max(config.num_labels, 1), (batch, size, size)),
    }
