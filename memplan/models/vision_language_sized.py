"""Vision-language families over Pixtral's vision tower, which takes each image at its own size (`image-text-to-text`):
Mistral 3 (model type "mistral3": Mistral Small 3.1 and 3.2) and LLaVA configs over a Pixtral tower (model type "llava",
vision_config "pixtral": pixtral-12b). memplan.models.vision_language's table names them ("sized"); what their
batches look like is here.

PixtralImageProcessor shrinks an image so that its longest edge is at most `size["longest_edge"]`, then rounds each side
up to a multiple of the patch a placeholder stands for (`get_resize_output_image_size`: the patch size times Mistral 3's
`spatial_merge_size`, 2; Pixtral's own 16 pixels), and hands the model `pixel_values` [batch, channels, height, width]
and `image_sizes` [batch, 2] (height, width), which the tower reads to cut each image's patches and get_image_features
to split the features (`.tolist()`); --image-size is the side of that resized square image, a multiple of that patch,
default and at most `vision_config.image_size` rounded up to one (the longest edge the checkpoints' processors resize
to: 1,540 for Mistral Small 3.1, 1,024 for pixtral-12b, multiples already). The model makes one feature a patch (Mistral
3's Mistral3PatchMerger merges 2 x 2 of them: modeling_mistral3.py, Mistral3Model.get_image_features;
LlavaModel.get_image_features keeps them all, "full"). PixtralProcessor writes, for each row of them, `[IMG]` once a
feature and `[IMG_BREAK]`, the last row's `[IMG_END]` instead (processing_pixtral.py, `replace_image_token`): the break
and end tokens are text tokens to the model, counted in --seq-len.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.models.vision_language_tiles import ordinary_ids
from memplan.settings import TrainingSettings

SIZED = "sized"  # the pixel layout of memplan.models.vision_language.FAMILIES that this module makes


def _placeholder_patch(config: Any) -> int:
    """The pixels a side of one placeholder's patch: the tower's patch, times Mistral 3's spatial_merge_size."""
    return config.vision_config.patch_size * getattr(config, "spatial_merge_size", 1)


def sized_image_size(config: Any, settings: TrainingSettings) -> int:
    """--image-size: the resized image's side, a multiple of the placeholder's patch, at most the tower's image_size."""
    step = _placeholder_patch(config)
    largest = -(-config.vision_config.image_size // step) * step  # (the processor rounds a side up to the patch)
    size = settings.image_size or largest
    if size % step or size > largest or size < step:
        merged = f" x spatial_merge_size {config.spatial_merge_size}" if hasattr(config, "spatial_merge_size") else ""
        nearest = min(largest, max(step, size // step * step))
        raise SettingsError(
            f"--image-size {size}: {config.model_type}'s processor resizes images to a multiple of {step} pixels a "
            f"side (patch_size {config.vision_config.patch_size}{merged}), at most {largest} (vision_config.image_size "
            f"{config.vision_config.image_size}, rounded up): use --image-size {nearest}"
        )
    return size


def sized_image_tokens(config: Any, size: int) -> int:
    """The tokens the processor writes for one image: a row of placeholders and a break (or end) token, each row."""
    side = size // _placeholder_patch(config)
    return side * (side + 1)


def sized_batch(
    config: Any, settings: TrainingSettings, dtype: torch.dtype, image_token: int, text_ids: list[int]
) -> dict[str, torch.Tensor]:
    """The batch the processor and a training collator hand the model: the image's tokens first (module docstring),
    then `text_ids`; labels the ids with the placeholders -100; the pixels and their sizes. Made of Python numbers
    where the model reads the values (memplan.models.vision_language)."""
    batch, size = settings.batch_size, settings.image_size
    side = size // _placeholder_patch(config)
    image_break, image_end = ordinary_ids(image_token, 2)
    image: list[int] = []
    for row in range(side):
        image += [image_token] * side + [image_end if row == side - 1 else image_break]
    row_ids = image + text_ids
    row_labels = [-100 if token == image_token else token for token in row_ids]
    channels = getattr(config.vision_config, "num_channels", 3)
    return {
        "input_ids": torch.tensor([row_ids] * batch, dtype=torch.long),
        "labels": torch.tensor([row_labels] * batch, dtype=torch.long),
        "pixel_values": torch.randn(batch, channels, size, size, dtype=dtype),
        "image_sizes": torch.tensor([[size, size]] * batch, dtype=torch.long),
    }
