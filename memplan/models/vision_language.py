"""Vision-language models' training batches (`image-text-to-text`, AutoModelForImageTextToText): what each family's
processor and a training collator hand the model, and the lengths it allows.

One image a sample, its placeholder tokens first in the sequence (Gemma 3's between the begin- and end-of-image
tokens its processor writes around them), then the text: `input_ids` [batch, seq-len] hold `config.image_token_id`
once for each feature the vision tower makes of the image (as the processor expands its image token), `labels` are
`input_ids` with the image's tokens set to -100 (what TRL's SFT collators do), and the pixels are laid out as the
family's image processor makes them. --seq-len is the whole sequence, placeholders included (what the language model
runs over: its memory grows with it), at least one text token more than the image's; --image-size the side of the
square image the vision tower takes (its config's where the tower takes one size only).

The models read the placeholders' *values*: `get_placeholder_mask` checks that their count matches the features
(`torch_compilable_check(n_image_tokens * hidden == image_features.numel())`), `masked_scatter` writes the features
at them and its backward selects their gradients (`masked_select`, sized by the mask's trues); Qwen2-VL's M-RoPE
positions are computed from the token types and the image grid (`get_rope_index`, `.tolist()` and `.item()` of
them), and Qwen2.5-VL's attention windows from the grid; Gemma 3's attention masks hold the image's placeholders in
one bidirectional block, found from its token types. The batch memplan makes is its own: its token ids, token types
and image grids are made from Python numbers (`torch.tensor`), and under memplan's fake tensors keep their values
(memplan.estimator.fake_mode's TracingFakeMode: values made from Python numbers, and what ops over them alone
compute, are kept), so these reads answer as in the real run. Pixels are random values, never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.models.vision_language_mllama import CANVAS, mllama_batch, mllama_image_size
from memplan.models.vision_language_sized import SIZED, sized_batch, sized_image_size, sized_image_tokens
from memplan.models.vision_language_tiles import (
    CROPS,
    TILED_PIXELS,
    TILES,
    tiled_batch,
    tiled_image_size,
    tiled_image_tokens,
)
from memplan.settings import TrainingSettings

VISION_LANGUAGE_TASK = "image-text-to-text"
DEFAULT_SEQ_LEN = 512
DEFAULT_FREE_IMAGE_SIZE = 224  # a tower that takes any size (Qwen2-VL's): 224 x 224 pixels, 64 placeholders


@dataclass(frozen=True)
class VisionFamily:
    """How one model type's batch looks.

    `pixels`: "image", `pixel_values` [batch, channels, size, size] of the one size the tower's position embeddings
    hold (`vision_config.image_size`); "patches", Qwen2-VL's flattened patches [batch * patches, channels *
    temporal_patch_size * patch_size**2] with `image_grid_thw` [batch, 3] (1, size / patch_size, size / patch_size)
    and `mm_token_type_ids` (1 at the placeholders), any size a multiple of patch_size * spatial_merge_size.
    `token_types`: the batch carries `token_type_ids` (PaliGemma's prefix: 0 for the image and prompt, 1 for the
    suffix the loss is over; all 1 past the image here; Gemma 3's, 1 at the placeholders, are _gemma3_token_types').
    `source`: where transformers says so. "crops" (LLaVA-NeXT, LLaVA-OneVision) and "tiles" (Idefics2, Idefics3,
    SmolVLM): an image cut into several tower-sized ones, or one tile of the tower's size,
    memplan.models.vision_language_tiles.
    """

    pixels: str
    source: str
    token_types: bool = False


# transformers/models/<family>/modeling_<family>.py, 5.17-5.25.
FAMILIES: dict[str, VisionFamily] = {
    # LlavaModel.get_image_features: the tower's hidden states at vision_feature_layer, the first position dropped
    # where vision_feature_select_strategy is "default" ("full" keeps it), projected: one feature a position (a CLIP
    # tower's CLS and patches, a SigLIP tower's patches: _llava_features).
    "llava": VisionFamily("image", "llava/modeling_llava.py, LlavaModel.get_image_features"),
    # Qwen2VLModel.get_image_features: the patches merged spatial_merge_size**2 to one feature
    # (`image_grid_thw.prod(-1) // spatial_merge_size**2`); get_rope_index needs mm_token_type_ids.
    "qwen2_vl": VisionFamily("patches", "qwen2_vl/modeling_qwen2_vl.py, Qwen2VLModel.get_image_features"),
    # PaliGemmaModel.get_image_features: the SigLIP tower's last hidden state, one feature a patch, projected.
    "paligemma": VisionFamily(
        "image", "paligemma/modeling_paligemma.py, PaliGemmaModel.get_image_features", token_types=True
    ),
    # Qwen2_5_VLModel.get_image_features: as Qwen2-VL's (its vision tower attends within windows,
    # `get_vision_window_index` of the grid, transformers/vision_utils.py); the same inputs.
    "qwen2_5_vl": VisionFamily("patches", "qwen2_5_vl/modeling_qwen2_5_vl.py, Qwen2_5_VLModel.get_image_features"),
    # Qwen3VLModel.get_image_features: as Qwen2-VL's (the tower's position embeddings interpolated bilinearly to the
    # grid; the merged features of its deepstack_visual_indexes blocks added at the placeholders in the first language
    # layers, Qwen3VLTextModel._deepstack_process's `hidden_states[visual_pos_masks, :]`); the same inputs.
    "qwen3_vl": VisionFamily("patches", "qwen3_vl/modeling_qwen3_vl.py, Qwen3VLModel.get_image_features"),
    # Gemma3Model.get_image_features: the SigLIP tower's last hidden state average-pooled to mm_tokens_per_image
    # features (Gemma3MultiModalProjector); its processor frames them and marks them (_gemma3_framing).
    "gemma3": VisionFamily("image", "gemma3/modeling_gemma3.py, Gemma3Model.get_image_features"),
    # LLaVA-NeXT's anyres crops and Idefics3 / SmolVLM's tiles: memplan.models.vision_language_tiles.
    "llava_next": VisionFamily(CROPS, "llava_next/modeling_llava_next.py, LlavaNextModel.get_image_features"),
    "idefics3": VisionFamily(TILES, "idefics3/modeling_idefics3.py, Idefics3Model.get_image_features"),
    "smolvlm": VisionFamily(TILES, "smolvlm/modeling_smolvlm.py, SmolVLMModel.get_image_features"),
    # LLaVA-OneVision's anyres crops (its own count) and Idefics2's tile (its perceiver's latents): the same module.
    "llava_onevision": VisionFamily(
        CROPS, "llava_onevision/modeling_llava_onevision.py, LlavaOnevisionModel.get_image_features"
    ),
    "idefics2": VisionFamily(TILES, "idefics2/modeling_idefics2.py, Idefics2Model.get_image_features"),
    # Mistral3Model.get_image_features: Pixtral's tower over each image at its size, 2 x 2 patches merged to one
    # feature (Mistral3PatchMerger): memplan.models.vision_language_sized.
    "mistral3": VisionFamily(SIZED, "mistral3/modeling_mistral3.py, Mistral3Model.get_image_features"),
    # MllamaModel: the tower over every image's max_num_tiles tiles, read by the language model's cross-attention
    # layers; one image token in the text: memplan.models.vision_language_mllama.
    "mllama": VisionFamily(CANVAS, "mllama/modeling_mllama.py, MllamaModel.forward"),
}
# A LLaVA config over Pixtral's tower (pixtral-12b): LlavaModel.get_image_features passes the images' sizes to the tower
# and keeps a feature a patch ("full"), laid out as Mistral 3's without the merge.
PIXTRAL_LLAVA = VisionFamily(SIZED, "llava/modeling_llava.py, LlavaModel.get_image_features over PixtralVisionModel")


def family(config: Any) -> VisionFamily:
    """The model type's row, or one line naming the ones memplan makes batches for."""
    if config.model_type == "llava" and config.vision_config.model_type == "pixtral":
        if config.vision_feature_select_strategy != "full":
            # Pixtral's tower runs a batch's images as one sequence: "default"'s `[:, 1:]` drops the first image's first
            # patch alone, and the split into images that follows fails (in transformers' own run too).
            raise SettingsError(
                f"llava over a Pixtral tower with vision_feature_select_strategy "
                f"{config.vision_feature_select_strategy!r}: its model drops one patch of the batch's first image and "
                "cannot split the rest into images (pixtral-12b's config has 'full'): set it to 'full'"
            )
        return PIXTRAL_LLAVA
    row = FAMILIES.get(config.model_type)
    if row is None:
        raise SettingsError(
            f"memplan makes {VISION_LANGUAGE_TASK} batches for {', '.join(FAMILIES)}, not {config.model_type} (whose "
            "processor lays out its images and placeholder tokens otherwise): give the model, its batch and loss as "
            "your own module:function (docs/usage.md)"
        )
    return row


# Positions a LLaVA tower puts before its patches: CLIPVisionEmbeddings prepends its class embedding, SigLIP's
# SiglipVisionEmbeddings none (modeling_clip.py, modeling_siglip.py). LlavaModel.get_image_features drops the first
# position for the "default" strategy whichever it is (`selected_image_feature[:, 1:]`): a SigLIP tower's first patch.
_CLASS_POSITIONS = {"clip_vision_model": 1, "siglip_vision_model": 0}


def _llava_features(config: Any, patches: int) -> int:
    """LLaVA's features (its placeholders) an image: the tower's positions, less the first for the "default"
    strategy."""
    tower = config.vision_config.model_type
    if tower not in _CLASS_POSITIONS:
        raise SettingsError(
            f"memplan makes llava batches for CLIP, SigLIP and Pixtral vision towers, not {tower} (whose processor "
            "lays out its images and placeholder tokens otherwise): give the model, its batch and loss as your own "
            "module:function (docs/usage.md)"
        )
    positions = patches + _CLASS_POSITIONS[tower]
    return positions - 1 if config.vision_feature_select_strategy == "default" else positions


def _patches_a_side(config: Any, size: int) -> int:
    return size // config.vision_config.patch_size


def image_tokens(config: Any, size: int) -> int:
    """The placeholders the processor writes for one image of `size` x `size` pixels: the features the model makes;
    for Idefics2 / Idefics3 / SmolVLM, with the tokens around them (vision_language_tiles.tiled_image_tokens), which
    their batch writes as text tokens (labels kept), where Gemma 3's framing tokens are _framing's (labels -100, as the
    image's)."""
    row = family(config)
    if config.model_type == "gemma3":
        return _gemma3_image_tokens(config, size)
    if row.pixels in TILED_PIXELS:
        return tiled_image_tokens(config, row.pixels, size)
    if row.pixels == SIZED:
        return sized_image_tokens(config, size)
    if row.pixels == CANVAS:
        return 1  # (the image's one token; the language model reads the tiles through cross-attention)
    patches = _patches_a_side(config, size) ** 2
    if row.pixels == "patches":
        return patches // config.vision_config.spatial_merge_size**2
    if config.model_type == "llava":
        return _llava_features(config, patches)
    return patches


def _gemma3_image_tokens(config: Any, size: int) -> int:
    """Gemma 3's features an image: Gemma3MultiModalProjector average-pools the tower's patches_per_image x
    patches_per_image patches with a kernel (and stride) of patches_per_image // int(mm_tokens_per_image ** 0.5)
    (nn.AvgPool2d, which drops a remainder): mm_tokens_per_image where that divides, as in Google's configs (64 x 64
    patches to 16 x 16, 256). The processor writes its image_seq_length (the same number) placeholders."""
    patches = _patches_a_side(config, size)
    kernel = patches // int(config.mm_tokens_per_image**0.5)
    return (patches // kernel) ** 2


def _gemma3_framing(config: Any) -> tuple[list[int], list[int]]:
    """The tokens Gemma 3's processor writes around an image's placeholders (processing_gemma3.py,
    `full_image_sequence`: "\\n\\n<boi>", the placeholders, "<eoi>\\n\\n"): begin- and end-of-image, which the
    model embeds as any text token (its token type 0, outside the image's bidirectional block); the newlines are
    text."""
    return [config.boi_token_id], [config.eoi_token_id]


def _framing(config: Any) -> tuple[list[int], list[int]]:
    """The tokens a family's processor writes before and after an image's placeholders (none for most)."""
    return _gemma3_framing(config) if config.model_type == "gemma3" else ([], [])


def _image_size(config: Any, row: VisionFamily, settings: TrainingSettings) -> int:
    if row.pixels == SIZED:
        return sized_image_size(config, settings)
    if row.pixels == CANVAS:
        return mllama_image_size(config, settings)
    if row.pixels in TILED_PIXELS:
        return tiled_image_size(config, row.pixels, settings)
    vision = config.vision_config
    if row.pixels == "patches":
        step = vision.patch_size * vision.spatial_merge_size
        size = settings.image_size or DEFAULT_FREE_IMAGE_SIZE
        if size % step:
            raise SettingsError(
                f"--image-size {size}: {config.model_type}'s processor resizes images to a multiple of {step} pixels "
                f"(patch_size {vision.patch_size} x spatial_merge_size {vision.spatial_merge_size}): use "
                f"--image-size {max(step, size // step * step)} or {(size // step + 1) * step}"
            )
        return size
    size = vision.image_size
    if settings.image_size is not None and settings.image_size != size:
        raise SettingsError(
            f"--image-size {settings.image_size}: {config.model_type}'s vision tower takes {size} x {size} images "
            f"only (vision_config.image_size, its position embeddings; the processor resizes to it): drop --image-size"
        )
    return size


def _max_positions(config: Any) -> int | None:
    value = getattr(config.text_config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def resolve_vision_language_lengths(config: Any, settings: TrainingSettings) -> TrainingSettings:
    """--image-size (the tower's) and --seq-len (all the tokens, the image's placeholders included) filled in and
    checked."""
    if settings.target_len is not None:
        raise SettingsError(
            f"--target-len has no place in an {VISION_LANGUAGE_TASK} model's batch, which takes --seq-len and "
            "--image-size: drop --target-len"
        )
    row = family(config)
    size = _image_size(config, row, settings)
    before, after = _framing(config)
    placeholders = image_tokens(config, size) + len(before) + len(after)  # (with the tokens framing them)
    limit = _max_positions(config)
    # The default: DEFAULT_SEQ_LEN text tokens beside the image's placeholders where that is more than
    # DEFAULT_SEQ_LEN in all (LLaVA-1.5's 336-pixel tower makes 576, PaliGemma-448's 1,024: a default of 512 in all
    # left no text and was refused), within the language model's positions.
    wanted = placeholders + DEFAULT_SEQ_LEN if placeholders >= DEFAULT_SEQ_LEN else DEFAULT_SEQ_LEN
    seq_len = settings.seq_len or (min(wanted, limit) if limit else wanted)
    if seq_len <= placeholders:
        given = f"--seq-len {seq_len}" if settings.seq_len else f"the default --seq-len {seq_len}"
        raise SettingsError(
            f"{given} leaves no text beside the image's {placeholders} placeholder tokens ({size} x {size} pixels; "
            f"--seq-len counts them): use --seq-len {placeholders + 1} or more, or a smaller --image-size"
        )
    if limit is not None and seq_len > limit:
        raise SettingsError(
            f"--seq-len {seq_len} is longer than the language model's maximum of {limit} positions "
            f"(text_config.max_position_embeddings); use --seq-len {limit} or less"
        )
    return settings.replace(seq_len=seq_len, image_size=size)


def _image_token_id(config: Any) -> int:
    value = getattr(config, "image_token_id", None)
    return value if value is not None else config.image_token_index


def _text_ids(config: Any, count: int, image_token: int) -> list[int]:
    """`count` text ids, none a special token the model reads (the image placeholder, a vision start or video id)."""
    vocab = config.text_config.vocab_size
    special = {
        image_token,
        *(getattr(config, name, None) for name in ("video_token_id", "vision_start_token_id", "vision_end_token_id")),
    }
    ids = [token for token in range(min(vocab, count + len(special))) if token not in special]
    return [ids[index % len(ids)] for index in range(count)]


def vision_language_batch(config: Any, settings: TrainingSettings, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The batch a processor and a training collator hand the model (module docstring)."""
    from memplan.estimator.known_values import keep_values

    keep_values()  # (under memplan's fake tensors: the values below stay known through the model's reads)
    row = family(config)
    batch, seq_len, size = settings.batch_size, settings.seq_len, settings.image_size
    image_token = _image_token_id(config)
    placeholders = image_tokens(config, size)
    if row.pixels in TILED_PIXELS:  # (`placeholders` counts the tokens around the image, which tiled_batch writes)
        text_ids = _text_ids(config, seq_len - placeholders, image_token)
        return tiled_batch(config, row.pixels, settings, dtype, image_token, text_ids)
    if row.pixels == CANVAS:
        return mllama_batch(config, settings, dtype, image_token, _text_ids(config, seq_len - 1, image_token))
    if row.pixels == SIZED:  # (`placeholders` counts the break tokens, which sized_batch writes)
        return sized_batch(config, settings, dtype, image_token, _text_ids(config, seq_len - placeholders, image_token))
    before, after = _framing(config)
    image = before + [image_token] * placeholders + after
    text = seq_len - len(image)
    row_ids = image + _text_ids(config, text, image_token)
    row_labels = [-100] * len(image) + row_ids[len(image) :]
    # torch.tensor of Python numbers: values a fake tensor keeps (module docstring)
    out = {
        "input_ids": torch.tensor([row_ids] * batch, dtype=torch.long),
        "labels": torch.tensor([row_labels] * batch, dtype=torch.long),
    }
    vision = config.vision_config
    if row.pixels == "image":
        out["pixel_values"] = torch.randn(batch, getattr(vision, "num_channels", 3), size, size, dtype=dtype)
    else:
        side = _patches_a_side(config, size)
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        out["pixel_values"] = torch.randn(batch * side * side, patch, dtype=dtype)
        out["image_grid_thw"] = torch.tensor([[1, side, side]] * batch, dtype=torch.long)
        out["mm_token_type_ids"] = torch.tensor([[1] * placeholders + [0] * text] * batch, dtype=torch.int)
    if row.token_types:
        out["token_type_ids"] = torch.tensor([[0] * placeholders + [1] * text] * batch, dtype=torch.long)
    if config.model_type == "gemma3":
        out["token_type_ids"] = _gemma3_token_types(row_ids, image_token, batch)
    return out


def _gemma3_token_types(row_ids: list[int], image_token: int, batch: int) -> torch.Tensor:
    """Gemma 3's `token_type_ids`: 1 at the image's placeholders, 0 elsewhere (ProcessorMixin.create_mm_token_type_ids
    over Gemma3Processor.image_token_ids, renamed from mm_token_type_ids in Gemma3Processor.__call__), from which
    Gemma3Model makes the image's bidirectional block in the attention masks (get_block_sequence_ids_for_mask)."""
    return torch.tensor([[int(token == image_token) for token in row_ids]] * batch, dtype=torch.long)
