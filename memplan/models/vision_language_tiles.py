"""Vision-language families whose processor cuts an image into several tower-sized images (`image-text-to-text`):
LLaVA-NeXT's anyres crops, and Idefics3 / SmolVLM's tiles. memplan.models.vision_language's table names them
("crops", "tiles"); what their batches look like is here.

LLaVA-NeXT (model type "llava_next"; transformers/models/llava_next/): --image-size is the side of the original
(square) image. LlavaNextImageProcessor resizes it to the grid pinpoint `select_best_resolution` picks
(config.image_grid_pinpoints), cuts that into crops of the tower's size (vision_config.image_size) and adds the whole
image resized to one crop: `pixel_values` [batch, crops + 1, channels, size, size] (`image_size_to_num_patches`),
`image_sizes` [batch, 2] the original (height, width), which the model reads (`.tolist()`) to split the crops and unpad
their features. The placeholders are LlavaNextProcessor._get_number_of_features's count: the base crop's patches, and
the grid's patches with the padding the resize added taken off (`_get_unpadded_features`, as the model's
`unpad_image`), plus one `image_newline` a row.

LLaVA-OneVision (model type "llava_onevision"; transformers/models/llava_onevision/): LLaVA-NeXT's crops and
`image_sizes`, and the processor's `batch_num_images` (one image a sample: [1] * batch), which the model reads to patch
each single image. Its own count (LlavaOnevisionProcessor._get_number_of_features): the base crop's patches, the
grid's unpadded patches, downsampled where they pass `vision_aspect_ratio`'s "anyres_max_N" (N crops' worth) by more
than 1.1 (the model's `nn.functional.interpolate` to `int(side // ratio)` a side, pack_image_features), and one
`image_newline` a row of what remains.

Idefics3 and SmolVLM (model types "idefics3", "smolvlm"): one image a sample, cut into tiles as their image processors
cut it (image_processing_idefics3.py, image_processing_smolvlm.py: `do_image_splitting`, on by default): the image's
longest edge resized to `size["longest_edge"]` (--image-size; default 4 tiles of the tower a side, the processors'
default and their checkpoints'), that to a multiple of the tower's size (vision_config.image_size) a side, cut into
tiles of the tower's size, with the whole image resized to one tile beside them: `pixel_values` [batch, tiles + 1,
channels, size, size] (one image where --image-size is the tower's: not cut, as `do_image_splitting=False` lays it out)
and the padding mask the processor pads with, `pixel_attention_mask` [batch, tiles + 1, size, size] int64, all ones.
Each tile's patches are shuffled `scale_factor`**2 to one feature (Idefics3Connector.pixel_shuffle): `image_seq_len` =
(size / patch_size)**2 / scale_factor**2 placeholders a tile (Idefics3Model.__init__), which the processor writes as
`_prompt_split_image` does (processing_idefics3.py, processing_smolvlm.py): `<fake_token_around_image><row_r_col_c>` and
the placeholders for each tile, a newline after each row, then a newline and the whole image's
`<fake_token_around_image><global-img>` + `<image>` * image_seq_len + `<fake_token_around_image>`
(`_prompt_single_image`, the whole of an image not cut): text tokens around them, counted in --seq-len (the two
newlines as one token, as the checkpoints' tokenizers merge them). At the default, 17 tower-sized images a sample and
17 times the placeholders: memplan laid every image out as one tile until 2026-12-08. The model drops padding images
(all-zero pixels) by their values; memplan's batch holds none (memplan.estimator.padding_images).

Idefics2 (model type "idefics2"; transformers/models/idefics2/): the same pixels and mask (one image a sample, the
image processor's `do_image_splitting` off, as its default), resampled by the perceiver to
`perceiver_config.resampler_n_latents` features an image (Idefics2PerceiverResampler's latents), which the processor
writes as `<fake_token_around_image>` + `<image>` * image_seq_len + `<fake_token_around_image>` (processing_idefics2.py,
`image_str`): two text tokens around them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.settings import TrainingSettings

# The pixel layouts of memplan.models.vision_language.FAMILIES that this module makes.
CROPS = "crops"  # LLaVA-NeXT, LLaVA-OneVision
TILES = "tiles"  # Idefics2, Idefics3, SmolVLM
TILED_PIXELS = frozenset({CROPS, TILES})

# The text tokens the processor writes around an image's placeholders: processing_idefics3.py / processing_smolvlm.py,
# `_prompt_single_image`: <fake_token_around_image><global-img> before them, <fake_token_around_image> after;
# processing_idefics2.py, `image_str`: <fake_token_around_image> before and after.
TOKENS_AROUND_A_TILE = {"idefics2": 2, "idefics3": 3, "smolvlm": 3}
# Idefics3's and SmolVLM's image processors resize an image's longest edge to `size["longest_edge"]`, 4 tiles of the
# tower a side: Idefics3ImageProcessor's default is 4 * 364 with `max_image_size` 364 (image_processing_idefics3.py),
# SmolVLM's checkpoints' preprocessor configs 4 * 512 and 4 * 384 with their towers' sizes. The families that split.
SPLIT_TILES_A_SIDE = 4
SPLITTING = frozenset({"idefics3", "smolvlm"})
# The most tiles a side their processors write a token for: `<row_1_col_1>` to `<row_6_col_6>` (Idefics3Processor's
# row_col_ids, range(6)); past it a tile's token is several of the tokenizer's, which memplan does not count. And the
# longest edge their first resize makes: MAX_IMAGE_SIZE (image_processing_idefics3.py, 4096 pixels).
MOST_TILES_A_SIDE = 6
MOST_PIXELS_A_SIDE = 4096


def _best_resolution(config: Any, size: int) -> tuple[int, int]:
    """The grid pinpoint LLaVA-NeXT's processor resizes a `size` x `size` image to (height, width)."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution((size, size), config.image_grid_pinpoints)
    return int(height), int(width)


def llava_next_crops(config: Any, size: int) -> int:
    """The tower-sized images LLaVA-NeXT's processor makes of one image: the grid's crops and the whole image
    (modeling_llava_next.py, `image_size_to_num_patches`)."""
    tower = config.vision_config.image_size
    height, width = _best_resolution(config, size)
    return (height // tower) * (width // tower) + 1


def llava_next_placeholders(config: Any, size: int) -> int:
    """LlavaNextProcessor._get_number_of_features (processing_llava_next.py) for a `size` x `size` image, less the CLS
    position its `num_additional_image_tokens` adds and the "default" feature strategy takes off."""
    vision = config.vision_config
    tower, patch = vision.image_size, vision.patch_size
    side = tower // patch  # patches a side of one crop
    current_height, current_width = _unpadded_grid(config, size)
    return current_height * current_width + current_height + side * side


def _unpadded_grid(config: Any, size: int) -> tuple[int, int]:
    """The patches (height, width) of the grid a `size` x `size` image is resized to, the padding the resize added
    taken off: `_get_unpadded_features`'s (processing_llava_next.py, processing_llava_onevision.py) with a square
    original, its aspect ratio 1 against the grid's."""
    vision = config.vision_config
    tower, patch = vision.image_size, vision.patch_size
    best_height, best_width = _best_resolution(config, size)
    side = tower // patch  # patches a side of one crop
    current_height, current_width = side * (best_height // tower), side * (best_width // tower)
    if 1 > current_width / current_height:
        new_height = int(round(size * (current_width / size), 7))
        current_height -= (current_height - new_height) // 2 * 2
    else:
        new_width = int(round(size * (current_height / size), 7))
        current_width -= (current_width - new_width) // 2 * 2
    return current_height, current_width


def llava_onevision_placeholders(config: Any, size: int) -> int:
    """LlavaOnevisionProcessor._get_number_of_features (processing_llava_onevision.py) for a `size` x `size` image,
    as its `replace_image_token` writes them (the CLS position a "default" strategy drops not counted: the model
    checks that a crop's features are its patches, pack_image_features): the base crop's patches, the grid's unpadded
    patches, downsampled where they are more than 1.1 times the side `vision_aspect_ratio`'s "anyres_max_N" allows
    (N crops' patches; the model's interpolate), and one newline a row."""
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    current_height, current_width = _unpadded_grid(config, size)
    unpadded, newlines = current_height * current_width, current_height
    # (the processor's and model's `int(vision_aspect_ratio.strip("anyres_max_"))`: the same number for these names)
    max_num_patches = int(config.vision_aspect_ratio.removeprefix("anyres_max_"))
    ratio = math.sqrt(current_height * current_width / (max_num_patches * side**2))
    if ratio > 1.1:
        unpadded = int(current_height // ratio) * int(current_width // ratio)
        newlines = int(current_height // ratio)
    return unpadded + newlines + side * side


def crop_placeholders(config: Any, size: int) -> int:
    """The placeholders of one `size` x `size` image of a family with anyres crops."""
    if config.model_type == "llava_onevision":
        return llava_onevision_placeholders(config, size)
    return llava_next_placeholders(config, size)


def idefics3_placeholders(config: Any) -> int:
    """Idefics3Model.__init__'s `image_seq_len`: the tower's patches, `scale_factor`**2 shuffled to one feature."""
    vision = config.vision_config
    return int(((vision.image_size // vision.patch_size) ** 2) / (config.scale_factor**2))


def tile_placeholders(config: Any) -> int:
    """The features of one tile: Idefics2's perceiver latents (Idefics2PerceiverResampler), Idefics3's shuffled
    patches."""
    if config.model_type == "idefics2":
        return config.perceiver_config.resampler_n_latents
    return idefics3_placeholders(config)


def tiles_a_side(config: Any, size: int) -> int:
    """The tiles a side an Idefics3 / SmolVLM image processor cuts a `size` x `size` image into (1: not cut). It resizes
    the image to `size["longest_edge"]` (here `size`), then to a multiple of the tower's size a side
    (`resize_for_vision_encoder`: `math.ceil(side / max_image_size) * max_image_size`) and cuts that into tiles of the
    tower's size where it is larger than one (`split_images`), adding the whole image resized to one tile."""
    if config.model_type not in SPLITTING:
        return 1
    # (the first resize makes an odd longest edge even: _resize_output_size_rescale_to_max_len)
    resized = size + size % 2
    return math.ceil(resized / config.vision_config.image_size)


def tile_images(config: Any, size: int) -> int:
    """The tower-sized images a sample holds: the tiles and the whole image, or the one image not cut."""
    side = tiles_a_side(config, size)
    return side * side + 1 if side > 1 else 1


def _split_image_layout(config: Any, size: int, image_token: int) -> list[int]:
    """The tokens Idefics3's and SmolVLM's processors write for one image (processing_idefics3.py,
    processing_smolvlm.py): `_prompt_single_image` where it is not cut, `<fake_token_around_image><global-img>`, the
    placeholders, `<fake_token_around_image>`; `_prompt_split_image` where it is: for each tile
    `<fake_token_around_image><row_r_col_c>` and its placeholders, a newline after each row, then a newline and the
    whole image's as `_prompt_single_image`'s. The newline after the last row and the one before the whole image are
    one token (two newlines are one token in SmolLM2's and Llama 3's byte-level vocabularies). The framing tokens, the
    row-and-column ones and the newlines are ordinary tokens to the model: any ids but the image's."""
    fake, global_image, row_col, newline = ordinary_ids(image_token, 4)
    placeholders = [image_token] * tile_placeholders(config)
    whole = [fake, global_image, *placeholders, fake]
    side = tiles_a_side(config, size)
    if side == 1:
        return whole
    tiles: list[int] = []
    for _ in range(side):
        for _ in range(side):
            tiles += [fake, row_col, *placeholders]
        tiles.append(newline)  # (the last row's with the one before the whole image: one token)
    return tiles + whole


def split_image_tokens(config: Any, size: int) -> int:
    """How many tokens _split_image_layout writes for one image."""
    return len(_split_image_layout(config, size, -1))


def ordinary_ids(image_token: int, count: int) -> list[int]:
    """`count` token ids the model reads as ordinary text: any but the image's (the tokens a processor writes around an
    image's placeholders: framing, row and column, break and end tokens)."""
    return [token for token in range(count + 1) if token != image_token][:count]


def tiled_image_tokens(config: Any, pixels: str, size: int) -> int:
    """The tokens the processor writes for one image: LLaVA-NeXT's or LLaVA-OneVision's placeholders; Idefics2's,
    Idefics3's and the tokens around them."""
    if pixels == CROPS:
        return crop_placeholders(config, size)
    if config.model_type in SPLITTING:
        return split_image_tokens(config, size)
    return tile_placeholders(config) + TOKENS_AROUND_A_TILE[config.model_type]


def tiled_image_size(config: Any, pixels: str, settings: TrainingSettings) -> int:
    """LLaVA-NeXT: the original image's side, any (default: the largest grid pinpoint's longer side, an image as large
    as the largest grid, as photos are). Idefics3 / SmolVLM: the longest edge their image processor resizes the image
    to, any (default SPLIT_TILES_A_SIDE tiles of the tower). Idefics2: the tower's size (module docstring)."""
    vision = config.vision_config
    if pixels == CROPS:
        if config.model_type == "llava_next" and config.vision_feature_select_strategy != "default":
            raise SettingsError(
                f"llava_next with vision_feature_select_strategy {config.vision_feature_select_strategy!r}: its "
                "model packs a crop's features as patches only (pack_image_features refuses the CLS position): "
                "memplan makes llava_next batches for the 'default' strategy"
            )
        return settings.image_size or max(max(point) for point in config.image_grid_pinpoints)
    size = vision.image_size
    if config.model_type in SPLITTING:
        # (the processor's default and its checkpoints': split into SPLIT_TILES_A_SIDE tiles a side and the whole)
        chosen = settings.image_size or SPLIT_TILES_A_SIDE * size
        most = min(MOST_PIXELS_A_SIDE, MOST_TILES_A_SIDE * size)
        if chosen > most:
            raise SettingsError(
                f"--image-size {chosen}: {config.model_type}'s processor resizes an image to at most "
                f"{MOST_PIXELS_A_SIDE} pixels a side and writes tokens for at most {MOST_TILES_A_SIDE} tiles of its "
                f"{size}-pixel tower a side: use --image-size {most} or less"
            )
        return chosen
    if settings.image_size is not None and settings.image_size != size:
        raise SettingsError(
            f"--image-size {settings.image_size}: memplan lays out {config.model_type}'s image as one tile of its "
            f"vision tower's {size} x {size} (vision_config.image_size; the processor's do_image_splitting=False): "
            "drop --image-size"
        )
    return size


def tiled_batch(
    config: Any, pixels: str, settings: TrainingSettings, dtype: torch.dtype, image_token: int, text_ids: list[int]
) -> dict[str, torch.Tensor]:
    """The batch a processor and a training collator hand the model (module docstring): the image's tokens first,
    then `text_ids`; labels the ids with the image placeholders -100. Made of Python numbers where the model reads
    the values (memplan.models.vision_language)."""
    batch, size = settings.batch_size, settings.image_size
    vision = config.vision_config
    channels, tower = getattr(vision, "num_channels", 3), vision.image_size
    if pixels == CROPS:
        image = [image_token] * crop_placeholders(config, size)
    elif config.model_type in SPLITTING:
        image = _split_image_layout(config, size, image_token)
    else:
        # ordinary tokens to the model: <fake_token_around_image> (Idefics2's)
        before = ordinary_ids(image_token, TOKENS_AROUND_A_TILE[config.model_type] - 1)
        image = [*before, *[image_token] * tile_placeholders(config), before[0]]
    row_ids = image + text_ids
    row_labels = [-100 if token == image_token else token for token in row_ids]
    out = {
        "input_ids": torch.tensor([row_ids] * batch, dtype=torch.long),
        "labels": torch.tensor([row_labels] * batch, dtype=torch.long),
    }
    if pixels == CROPS:
        out["pixel_values"] = torch.randn(batch, llava_next_crops(config, size), channels, tower, tower, dtype=dtype)
        out["image_sizes"] = torch.tensor([[size, size]] * batch, dtype=torch.long)
        if config.model_type == "llava_onevision":  # (LlavaOnevisionImageProcessor's; the model reads its values)
            out["batch_num_images"] = torch.tensor([1] * batch, dtype=torch.long)
    else:
        images = tile_images(config, size)
        out["pixel_values"] = torch.randn(batch, images, channels, tower, tower, dtype=dtype)
        out["pixel_attention_mask"] = torch.ones(batch, images, tower, tower, dtype=torch.long)
    return out
