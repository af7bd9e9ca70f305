"""Mllama (model type "mllama": Llama 3.2 Vision), an `image-text-to-text` family whose language model reads the image
through cross-attention layers, not placeholders in its sequence. memplan.models.vision_language's table names its
layout ("canvas"); what its batch looks like is here.

MllamaImageProcessor resizes an image onto a canvas of tiles of the tower's size (vision_config.image_size, 560 for
Meta's checkpoints) chosen among `supported_aspect_ratios`, and pads every image to `max_num_tiles` tiles with zeros:
`pixel_values` [batch, images, max_num_tiles, channels, size, size], with `aspect_ratio_ids` [batch, images] (the
canvas's index in supported_aspect_ratios, from 1) and `aspect_ratio_mask` [batch, images, max_num_tiles] (1 at the
canvas's tiles). The tower runs all max_num_tiles tiles of each image whatever the canvas (MllamaVisionModel.forward
reshapes them to batch * images * tiles), so the canvas moves no memory: memplan lays out a square photo larger than
one tile, the square canvas of the most tiles (2 x 2 of 4 for Meta's checkpoints), and takes no --image-size but the
tower's. The processor writes one `<|image|>` token an image in the text (image_token_index), and MllamaProcessor's
`cross_attention_mask` [batch, seq, images, max_num_tiles] lets each token from the image's on attend to its canvas's
tiles (`convert_sparse_cross_attention_mask_to_dense`); labels are the ids with the image token -100 (hand-written
recipes mask it; TRL's current collator masks only padding: the first position is never a target of the shifted loss,
so the memory is the same). One image a sample, its token first (`build_string_from_input` writes it before
`<|begin_of_text|>`). The processor pads to its own `max_image_tiles` and numbers canvases among its ratios; memplan
reads `vision_config.max_num_tiles` and `supported_aspect_ratios`, which agree for Meta's checkpoints (the model
cannot run where they differ).
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.settings import TrainingSettings

CANVAS = "canvas"  # the pixel layout of memplan.models.vision_language.FAMILIES that this module makes


def mllama_image_size(config: Any, settings: TrainingSettings) -> int:
    """The tower's tile size, the only --image-size (module docstring: the canvas moves no memory)."""
    size = config.vision_config.image_size
    if settings.image_size is not None and settings.image_size != size:
        raise SettingsError(
            f"--image-size {settings.image_size}: mllama's image processor pads every image to max_num_tiles tiles of "
            f"its tower's {size} x {size}, which the tower runs whatever the image's size: drop --image-size"
        )
    return size


def _canvas(config: Any) -> tuple[int, int]:
    """The largest square canvas supported (its tiles a side) and its aspect-ratio id."""
    vision = config.vision_config
    ratios = [list(ratio) for ratio in vision.supported_aspect_ratios]
    sides = [rows for rows, cols in ratios if rows == cols and rows * cols <= vision.max_num_tiles]
    if not sides:
        return 1, 1
    side = max(sides)
    return side, ratios.index([side, side]) + 1


def mllama_batch(
    config: Any, settings: TrainingSettings, dtype: torch.dtype, image_token: int, text_ids: list[int]
) -> dict[str, torch.Tensor]:
    """The batch MllamaProcessor and a training collator hand the model (module docstring): the image token, then
    `text_ids`. Made of Python numbers where the model reads the values (memplan.models.vision_language)."""
    vision = config.vision_config
    batch, size, seq_len = settings.batch_size, settings.image_size, settings.seq_len
    tiles, (side, ratio_id) = vision.max_num_tiles, _canvas(config)
    used = [1] * (side * side) + [0] * (tiles - side * side)
    row_ids = [image_token, *text_ids]
    return {
        "input_ids": torch.tensor([row_ids] * batch, dtype=torch.long),
        "labels": torch.tensor([[-100, *text_ids]] * batch, dtype=torch.long),
        "pixel_values": torch.randn(batch, 1, tiles, getattr(vision, "num_channels", 3), size, size, dtype=dtype),
        "aspect_ratio_ids": torch.tensor([[ratio_id]] * batch, dtype=torch.long),
        "aspect_ratio_mask": torch.tensor([[used]] * batch, dtype=torch.long),
        "cross_attention_mask": torch.tensor([[[used]] * seq_len] * batch, dtype=torch.long),
    }
