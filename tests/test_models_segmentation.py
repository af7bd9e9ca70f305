"""Semantic segmentation as a task (`semantic-segmentation`: SegFormer, BEiT, Data2Vec-vision, DPT, MobileNetV2 /
MobileViT / MobileViTV2 DeepLabV3, UperNet over ConvNeXt), each estimate against the same model trained for real on
the CPU, measured by the CPU allocator's events (oneDNN off: ATen's own convolution backends, whose im2col columns
memplan models)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from memplan.errors import SettingsError
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.case_sets import with_extended
from tests.task_steps import assert_not_under_and_close, case_id, predicted_config_peak

BATCH = 2
SIZE = 64  # the images' side: --image-size

# Tiny configs, structurally the real thing; 5 classes.
CONVNEXT = {
    "model_type": "convnext",
    "hidden_sizes": [8, 16, 32, 64],
    "depths": [1, 1, 1, 1],
    "out_features": ["stage1", "stage2", "stage3", "stage4"],
}
VIT_SIZES = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 64}
CONFIGS: dict[str, dict[str, Any]] = {
    "segformer": {
        "model_type": "segformer",
        "architectures": ["SegformerForSemanticSegmentation"],
        "num_encoder_blocks": 4,
        "depths": [1, 1, 1, 1],
        "hidden_sizes": [16, 32, 64, 128],
        "num_attention_heads": [1, 2, 4, 8],
        "sr_ratios": [8, 4, 2, 1],
        "decoder_hidden_size": 64,
        "num_labels": 5,
    },
    "beit": {
        "model_type": "beit",
        "architectures": ["BeitForSemanticSegmentation"],
        **VIT_SIZES,
        "image_size": SIZE,
        "patch_size": 8,
        "out_indices": [1, 2, 3, 4],
        "auxiliary_channels": 16,
        "num_labels": 5,
    },
    "data2vec-vision": {
        "model_type": "data2vec-vision",
        "architectures": ["Data2VecVisionForSemanticSegmentation"],
        **VIT_SIZES,
        "image_size": SIZE,
        "patch_size": 8,
        "out_indices": [1, 2, 3, 4],
        "auxiliary_channels": 16,
        "num_labels": 5,
    },
    "dpt": {
        "model_type": "dpt",
        "architectures": ["DPTForSemanticSegmentation"],
        **VIT_SIZES,
        "image_size": SIZE,
        "patch_size": 8,
        "backbone_out_indices": [0, 1, 2, 3],
        "neck_hidden_sizes": [16, 16, 32, 32],
        "fusion_hidden_size": 16,
        "num_labels": 5,
    },
    "mobilevit": {
        "model_type": "mobilevit",
        "architectures": ["MobileViTForSemanticSegmentation"],
        "image_size": SIZE,
        "hidden_sizes": [16, 24, 32],
        "neck_hidden_sizes": [8, 8, 16, 16, 24, 32, 64],
        "aspp_out_channels": 32,
        "num_labels": 5,
    },
    "mobilevitv2": {
        "model_type": "mobilevitv2",
        "architectures": ["MobileViTV2ForSemanticSegmentation"],
        "image_size": SIZE,
        "width_multiplier": 0.25,
        "aspp_out_channels": 32,
        "num_labels": 5,
    },
    "mobilenet_v2": {
        "model_type": "mobilenet_v2",
        "architectures": ["MobileNetV2ForSemanticSegmentation"],
        "image_size": SIZE,
        "depth_multiplier": 0.25,
        "num_labels": 5,
    },
    # UperNet builds its backbone from backbone_config (load_backbone): a tiny ConvNeXt
    "upernet": {
        "model_type": "upernet",
        "architectures": ["UperNetForSemanticSegmentation"],
        "backbone_config": CONVNEXT,
        "hidden_size": 16,
        "auxiliary_channels": 16,
        "num_labels": 5,
    },
    # num_labels 1: SegFormer's binary head, BCE with logits over the valid pixels
    "segformer-binary": {
        "model_type": "segformer",
        "architectures": ["SegformerForSemanticSegmentation"],
        "num_encoder_blocks": 4,
        "depths": [1, 1, 1, 1],
        "hidden_sizes": [16, 32, 64, 128],
        "num_attention_heads": [1, 2, 4, 8],
        "sr_ratios": [8, 4, 2, 1],
        "decoder_hidden_size": 64,
        "num_labels": 1,
    },
}


def measured_peak(family: str, precision: str, checkpoint: bool, attn_impl: str) -> int:
    """The canonical loop, written plainly: AutoModelForSemanticSegmentation from the config, the batch a segmentation
    collator makes (images, a class id per pixel), AdamW, `model(**batch).loss.backward()`, step,
    zero_grad(set_to_none=True); `--checkpoint all` as transformers' gradient_checkpointing_enable() runs it. The third
    iteration's peak by the CPU allocator's events (tests/hand_measure.py, oneDNN off)."""
    from transformers import AutoConfig, AutoModelForSemanticSegmentation

    from tests.hand_measure import autocast_of, profiled_causal_lm_peak

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    config = AutoConfig.for_model(**CONFIGS[family])

    def model_of() -> torch.nn.Module:
        chosen = {} if attn_impl == "sdpa" else {"attn_implementation": attn_impl}  # sdpa: transformers' default
        model = AutoModelForSemanticSegmentation.from_config(config, **chosen).to(dtype)
        if checkpoint:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def batch_of() -> dict[str, torch.Tensor]:
        return {
            "pixel_values": torch.randn(BATCH, 3, SIZE, SIZE, dtype=dtype),
            "labels": torch.randint(0, max(config.num_labels, 1), (BATCH, SIZE, SIZE)),
        }

    return profiled_causal_lm_peak(model_of, batch_of, autocast_dtype=autocast_of(precision))


def predicted_peak(tmp_path: Path, family: str, precision: str, checkpoint: bool, attn_impl: str) -> int:
    return predicted_config_peak(
        tmp_path, CONFIGS[family], checkpoint, batch_size=BATCH, image_size=SIZE, precision=precision,
        attn_impl=attn_impl,
    )  # fmt: skip


CASES = [
    ("segformer", "fp32", False, "sdpa"),
    ("segformer", "bf16", True, "sdpa"),
    ("segformer", "amp-bf16", False, "sdpa"),
    ("segformer-binary", "fp32", False, "sdpa"),
    ("beit", "fp32", False, "sdpa"),
    ("beit", "fp32", False, "eager"),
    ("beit", "amp-bf16", True, "sdpa"),
    ("data2vec-vision", "bf16", False, "sdpa"),
    ("dpt", "fp32", False, "sdpa"),
    ("dpt", "amp-bf16", True, "eager"),
    ("mobilevit", "fp32", False, "sdpa"),
    ("mobilevit", "bf16", True, "sdpa"),
    ("mobilevitv2", "fp32", False, "sdpa"),
    ("mobilenet_v2", "amp-bf16", False, "sdpa"),
    ("upernet", "fp32", False, "sdpa"),
    ("upernet", "bf16", False, "sdpa"),
    ("upernet", "amp-bf16", False, "sdpa"),  # (transformers refuses UperNet's gradient checkpointing)
]


EXTENDED = {
    ("segformer", "amp-bf16", False, "sdpa"),
    ("beit", "fp32", False, "sdpa"),
    ("beit", "fp32", False, "eager"),
    ("data2vec-vision", "bf16", False, "sdpa"),
    ("dpt", "fp32", False, "sdpa"),
    ("segformer", "fp32", False, "sdpa"),
    ("mobilevit", "bf16", True, "sdpa"),  # 9.6 s: bfloat16 convolutions run slowly on the CPU
    ("upernet", "bf16", False, "sdpa"),
    ("upernet", "amp-bf16", False, "sdpa"),
    ("mobilenet_v2", "amp-bf16", False, "sdpa"),  # 12 s: its depthwise convolutions run slowly on the CPU
}


@pytest.mark.parametrize("case", with_extended(CASES, EXTENDED), ids=[case_id(*case) for case in CASES])
def test_a_segmentation_models_step_is_predicted_as_measured(tmp_path, case):
    """SegformerForSemanticSegmentation and the other segmentation heads had been refused ("a head none of memplan's
    tasks builds"): now estimated with the batch their forward takes, logits upsampled to the labels and the cross
    entropy over every pixel, never under the real CPU run and at most 0.5% over it (all of them exact to the byte
    when written)."""
    predicted = predicted_peak(tmp_path, *case)
    measured = measured_peak(*case)
    assert_not_under_and_close(case_id(*case), predicted, measured)


@pytest.mark.parametrize(
    ("config", "head"),
    [
        ({"model_type": "segformer", "architectures": ["SegformerForSemanticSegmentation"]}, None),
        ({"model_type": "upernet", "architectures": ["UperNetForSemanticSegmentation"]}, None),
        ({"model_type": "upernet"}, "UperNetForSemanticSegmentation"),  # its one head
    ],
)
def test_the_segmentation_task_is_read_from_the_config_or_guessed(tmp_path, config: dict[str, Any], head):
    from memplan.models.hf import resolve_hf

    (tmp_path / "config.json").write_text(json.dumps(config))
    source = resolve_hf(str(tmp_path), None)
    assert (source.task, source.guessed_class) == ("semantic-segmentation", head)


def test_a_head_that_refuses_one_label_is_refused_in_one_line(tmp_path):
    """BEiT's head raises "The number of labels should be greater than one" on labels with num_labels 1 (SegFormer's
    trains a binary mask instead, estimated above): said before the trace, naming the field to set."""
    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["beit"], "num_labels": 1}))
    spec = resolve_model(str(tmp_path))
    with pytest.raises(SettingsError, match="trains with 2 or more labels .*set num_labels"):
        spec.settings_for(TrainingSettings(batch_size=1, device="cpu"))


def test_a_length_the_batch_has_no_place_for_is_one_line_exit_2(tmp_path):
    from memplan.cli import main

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["segformer"]))
    result = CliRunner().invoke(main, ["estimate", str(tmp_path), "--seq-len", "64", "--device", "cpu"])
    assert result.exit_code == 2
    assert "--seq-len has no place in a semantic-segmentation model's batch, which takes --image-size" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_the_image_size_comes_from_the_config_or_its_backbone(tmp_path):
    """--image-size as for image classification: the config's image_size; UperNet's backbone_config's (a Swin
    backbone names one); 224 where neither does (SegFormer)."""
    cases = [
        (CONFIGS["beit"], SIZE),
        ({**CONFIGS["upernet"], "backbone_config": {"model_type": "swin", "image_size": 96}}, 96),
        (CONFIGS["segformer"], 224),
    ]
    for config, size in cases:
        (tmp_path / "config.json").write_text(json.dumps(config))
        spec = resolve_model(str(tmp_path))
        assert spec.settings_for(TrainingSettings(batch_size=1, device="cpu")).image_size == size


def test_a_model_type_memplan_makes_no_segmentation_batch_for_is_refused_in_one_line(tmp_path):
    """A ViT config asked for --task semantic-segmentation: no row in memplan.models.segmentation's table (transformers
    has no ViT segmentation head either), said before anything is built."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    spec = resolve_model(str(tmp_path), task="semantic-segmentation")
    with pytest.raises(SettingsError, match="makes semantic-segmentation batches for segformer, .*, not vit"):
        spec.settings_for(TrainingSettings(batch_size=1, device="cpu"))


@pytest.mark.parametrize("family", ["upernet"])  # a convolutional backbone, batch norms, upsampling
def test_the_cuda_target_traces_a_segmentation_step(tmp_path, family):
    import memplan

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[family]))
    result = memplan.estimate(str(tmp_path), batch_size=BATCH, image_size=SIZE, gpu="H100", precision="amp-bf16")
    assert result.peak_bytes > 0


def test_checkpoint_all_says_where_hugging_face_cannot_checkpoint_the_model(tmp_path):
    """UperNet's class does not support Hugging Face's gradient checkpointing (its own gradient_checkpointing_enable()
    raises, below): --checkpoint all checkpointed memplan's blocks without a word, a step the user's Trainer would
    refuse to run. A note says so; a model Hugging Face checkpoints (SegFormer) has none."""
    from transformers import AutoConfig, AutoModelForSemanticSegmentation

    import memplan
    from memplan.estimator.checkpointing import block_names, unsupported_checkpointing_notes

    config = dict(CONFIGS["upernet"])
    model = AutoModelForSemanticSegmentation.from_config(AutoConfig.for_model(**config))
    with pytest.raises(ValueError, match="does not support"):
        model.gradient_checkpointing_enable()
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = memplan.estimate(str(tmp_path), batch_size=BATCH, image_size=32, device="cpu", checkpoint="all")
    notes = [note for note in result.notes if "gradient checkpointing" in note]
    assert len(notes) == 1
    assert notes[0].startswith("UperNetForSemanticSegmentation does not support Hugging Face's")
    segformer = AutoModelForSemanticSegmentation.from_config(AutoConfig.for_model(**CONFIGS["segformer"]))
    segformer.gradient_checkpointing_enable()  # (supported)
    assert unsupported_checkpointing_notes(segformer, "all", block_names(segformer)) == []


if __name__ == "__main__":  # the table: python -m tests.test_models_segmentation
    import tempfile

    for case in CASES:
        with tempfile.TemporaryDirectory() as folder:
            predicted = predicted_peak(Path(folder), *case)
        measured = measured_peak(*case)
        print(f"| {case_id(*case)} | {measured:,} | {predicted:,} | {(predicted - measured) / measured:+.4%} |")
