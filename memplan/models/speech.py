"""Speech models' training batches: what each family's forward takes, and the lengths it allows.

Two tasks, one row per model type (transformers 5.x sources cited per row):

- `speech-seq2seq` (AutoModelForSpeechSeq2Seq): audio features in, `labels` out; the model shifts the labels
  right into its decoder's input (`shift_tokens_right` from `decoder_start_token_id`). --seq-len is the input's
  frames where the model takes a choice of them, --target-len the label tokens (DEFAULT_TARGET_LEN, at most the
  decoder's `max_target_positions`).
- `ctc` (AutoModelForCTC): a raw waveform, `input_values` [batch, samples], in; --seq-len is the samples
  (DEFAULT_SAMPLES: one second at 16 kHz), --target-len the label length (DEFAULT_CTC_LABELS), at most the frames
  the convolutional feature encoder makes of the samples: CTC aligns each label to a frame of its own, and a
  longer one has no alignment (the loss is inf, its gradient NaN).
- `audio-classification` (AutoModelForAudioClassification): the families' encoder input as above (a waveform, or
  Whisper's mel frames), or AST's spectrogram `input_values` [batch, max_length, num_mel_bins]; `labels` [batch], a
  class each. --seq-len is the samples (or the one frame count Whisper's and AST's encoders take); no --target-len.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.settings import TrainingSettings

SPEECH_TASKS = ("speech-seq2seq", "ctc", "audio-classification")
DEFAULT_TARGET_LEN = 448  # Whisper's max_target_positions, the longest transcript its checkpoints train on
DEFAULT_FRAMES = 3000  # 30 s of 10 ms feature frames: Whisper's window, for the models that take any length
DEFAULT_SAMPLES = 16_000  # one second of 16 kHz audio, wav2vec2's sampling rate
DEFAULT_CTC_LABELS = 32  # characters of a one-second utterance's transcript, at most the frames the audio makes


@dataclass(frozen=True)
class SpeechFamily:
    """How one model type's training batch looks.

    `inputs`: "mel-fixed", input_features [batch, num_mel_bins, frames] of the one length the encoder takes;
    "spectrogram-fixed", input_values [batch, max_length, num_mel_bins] of the one length the patch grid holds;
    "filterbank", input_features [batch, frames, input_feat_per_channel * input_channels] with an attention_mask
    of ones; "waveform", input_values [batch, samples] (float). `adapter`: the family's output lengths go through
    its adapter's convolutions too where the config's `add_adapter` is set. `source`: where transformers says so.
    """

    inputs: str
    source: str
    adapter: bool = False


# transformers/models/<family>/modeling_<family>.py, 5.17-5.25.
FAMILIES: dict[str, dict[str, SpeechFamily]] = {
    "speech-seq2seq": {
        # WhisperEncoder.forward: `expected_seq_length = max_source_positions * conv1.stride[0] * conv2.stride[0]`,
        # anything else a ValueError; WhisperForConditionalGeneration.forward: labels at most max_target_positions.
        "whisper": SpeechFamily("mel-fixed", "whisper/modeling_whisper.py, WhisperEncoder.forward"),
        # Speech2TextEncoder.forward: Conv1dSubsampler (num_conv_layers convolutions of stride 2), then sinusoidal
        # positions over the subsampled frames (its table holds max_source_positions), the attention mask subsampled
        # with it (_get_feature_vector_attention_mask).
        "speech_to_text": SpeechFamily("filterbank", "speech_to_text/modeling_speech_to_text.py, Speech2TextEncoder"),
    },
    "ctc": {
        # <Family>ForCTC.forward: input_values [batch, samples] through <Family>FeatureEncoder (conv_kernel,
        # conv_stride), ForCTCLoss (transformers/loss/loss_ctc.py) over _get_feat_extract_output_lengths' frames.
        "wav2vec2": SpeechFamily("waveform", "wav2vec2/modeling_wav2vec2.py", adapter=True),
        "wav2vec2-conformer": SpeechFamily("waveform", "wav2vec2_conformer/modeling_wav2vec2_conformer.py", True),
        "wavlm": SpeechFamily("waveform", "wavlm/modeling_wavlm.py", adapter=True),
        "data2vec-audio": SpeechFamily("waveform", "data2vec/modeling_data2vec_audio.py", adapter=True),
        "hubert": SpeechFamily("waveform", "hubert/modeling_hubert.py"),
        "unispeech": SpeechFamily("waveform", "unispeech/modeling_unispeech.py"),
        "unispeech-sat": SpeechFamily("waveform", "unispeech_sat/modeling_unispeech_sat.py"),
        "sew": SpeechFamily("waveform", "sew/modeling_sew.py"),
        "sew-d": SpeechFamily("waveform", "sew_d/modeling_sew_d.py"),
    },
    "audio-classification": {
        # <Family>ForSequenceClassification.forward: the same feature encoder over input_values [batch, samples],
        # the projector's output averaged over the frames (no attention_mask), CrossEntropyLoss over (batch,) labels.
        "wav2vec2": SpeechFamily("waveform", "wav2vec2/modeling_wav2vec2.py"),
        "wav2vec2-conformer": SpeechFamily("waveform", "wav2vec2_conformer/modeling_wav2vec2_conformer.py"),
        "wavlm": SpeechFamily("waveform", "wavlm/modeling_wavlm.py"),
        "data2vec-audio": SpeechFamily("waveform", "data2vec/modeling_data2vec_audio.py"),
        "hubert": SpeechFamily("waveform", "hubert/modeling_hubert.py"),
        "unispeech": SpeechFamily("waveform", "unispeech/modeling_unispeech.py"),
        "unispeech-sat": SpeechFamily("waveform", "unispeech_sat/modeling_unispeech_sat.py"),
        "sew": SpeechFamily("waveform", "sew/modeling_sew.py"),
        "sew-d": SpeechFamily("waveform", "sew_d/modeling_sew_d.py"),
        # WhisperForAudioClassification.forward: WhisperEncoder (its one input length, as above), mean over frames.
        "whisper": SpeechFamily("mel-fixed", "whisper/modeling_whisper.py, WhisperEncoder.forward"),
        # ASTEmbeddings.get_shape: the patch grid (and its position embeddings) from num_mel_bins and max_length.
        "audio-spectrogram-transformer": SpeechFamily(
            "spectrogram-fixed",
            "audio_spectrogram_transformer/modeling_audio_spectrogram_transformer.py, ASTEmbeddings.get_shape",
        ),
    },
}


def family(config: Any, task: str) -> SpeechFamily:
    """The model type's row, or one line naming the ones memplan makes batches for."""
    row = FAMILIES[task].get(config.model_type)
    if row is None:
        raise SettingsError(
            f"memplan makes {task} batches for {', '.join(FAMILIES[task])}, not {config.model_type} (whose forward "
            "takes other inputs): give the model, its batch and loss as your own module:function (docs/usage.md)"
        )
    return row


def _whisper_frames(config: Any) -> int:
    # WhisperEncoder: conv1 has stride 1, conv2 stride 2 (modeling_whisper.py, WhisperEncoder.__init__).
    return config.max_source_positions * 1 * 2


def _subsampled(frames: int, config: Any) -> int:
    # Speech2TextPreTrainedModel._get_feat_extract_output_lengths: `(length - 1) // 2 + 1` per convolution.
    for _ in range(config.num_conv_layers):
        frames = (frames - 1) // 2 + 1
    return frames


def _filterbank_frame_limit(config: Any) -> int:
    """The most frames whose subsampled length the encoder's position table holds (max_source_positions)."""
    return config.max_source_positions * 2**config.num_conv_layers


def ctc_frames(samples: int, config: Any, row: SpeechFamily) -> int:
    """The frames the feature encoder (and adapter) makes of `samples`: <Family>._get_feat_extract_output_lengths."""
    frames = samples
    for kernel, stride in zip(config.conv_kernel, config.conv_stride, strict=False):
        frames = (frames - kernel) // stride + 1
    if row.adapter and getattr(config, "add_adapter", False):
        for _ in range(config.num_adapter_layers):
            frames = (frames - 1) // config.adapter_stride + 1
    return frames


def input_limit(config: Any, task: str) -> int | None:
    """The longest --seq-len the model takes (None: no limit known)."""
    row = family(config, task)
    if row.inputs == "mel-fixed":
        return _whisper_frames(config)
    if row.inputs == "filterbank":
        return _filterbank_frame_limit(config)
    if row.inputs == "spectrogram-fixed":
        return config.max_length
    return None


def resolve_speech_lengths(config: Any, task: str, settings: TrainingSettings) -> TrainingSettings:
    """--seq-len (input frames, or samples) and --target-len (label tokens) filled in and checked."""
    if settings.image_size is not None:
        takes = "--seq-len" if task == "audio-classification" else "--seq-len and --target-len"
        raise SettingsError(
            f"--image-size has no place in {'an' if task[0] in 'aeiou' else 'a'} {task} model's batch, which takes "
            f"{takes}: drop --image-size"
        )
    row = family(config, task)
    if task == "audio-classification":
        return _classifier_lengths(config, row, settings)
    if row.inputs == "mel-fixed":
        frames = _whisper_frames(config)
        if settings.seq_len is not None and settings.seq_len != frames:
            raise SettingsError(
                f"--seq-len {settings.seq_len}: {config.model_type}'s encoder takes exactly {frames} mel frames "
                f"(2 x max_source_positions, {row.source}; shorter audio is padded to it): drop --seq-len"
            )
        return settings.replace(seq_len=frames, target_len=_target_len(config, settings))
    if row.inputs == "filterbank":
        limit = _filterbank_frame_limit(config)
        frames = settings.seq_len or min(DEFAULT_FRAMES, limit)
        if frames > limit:
            raise SettingsError(
                f"--seq-len {frames} frames subsample to {_subsampled(frames, config)}, more than the "
                f"{config.max_source_positions} positions the config's max_source_positions gives (transformers "
                "regrows the encoder's sinusoidal table past it; memplan estimates up to it, the length the model "
                f"was made for): use --seq-len {limit} or less"
            )
        return settings.replace(seq_len=frames, target_len=_target_len(config, settings))
    _refuse_spec_augment(config)
    _refuse_random_adapter_layers(config, row)
    samples = settings.seq_len or DEFAULT_SAMPLES
    frames = ctc_frames(samples, config, row)
    if frames < 1:
        raise SettingsError(
            f"--seq-len {samples} samples are too few for {config.model_type}'s feature encoder (conv_kernel "
            f"{list(config.conv_kernel)}, conv_stride {list(config.conv_stride)}), which makes no frame of them: "
            "give more samples"
        )
    labels = settings.target_len or min(DEFAULT_CTC_LABELS, frames)
    if labels > frames:
        raise SettingsError(
            f"--target-len {labels} labels are more than the {frames} frames {config.model_type}'s feature encoder "
            f"makes of {samples} samples; CTC aligns each label to a frame (the loss would be inf): use --target-len "
            f"{frames} or less, or more samples (--seq-len)"
        )
    return settings.replace(seq_len=samples, target_len=labels)


def _classifier_lengths(config: Any, row: SpeechFamily, settings: TrainingSettings) -> TrainingSettings:
    """An audio classifier's --seq-len (samples, or the one frame count its encoder takes); its labels are one class
    per sample, so --target-len has no place."""
    if settings.target_len is not None:
        raise SettingsError(
            "--target-len has no place in an audio-classification model's batch (one label per sample), which takes "
            "--seq-len: drop --target-len"
        )
    if row.inputs in ("mel-fixed", "spectrogram-fixed"):
        frames = input_limit(config, "audio-classification")
        if settings.seq_len is not None and settings.seq_len != frames:
            field = "2 x max_source_positions" if row.inputs == "mel-fixed" else "max_length"
            raise SettingsError(
                f"--seq-len {settings.seq_len}: {config.model_type}'s encoder takes exactly {frames} frames ({field}, "
                f"{row.source}; shorter audio is padded to it): drop --seq-len"
            )
        return settings.replace(seq_len=frames)
    _refuse_spec_augment(config)
    samples = settings.seq_len or DEFAULT_SAMPLES
    if ctc_frames(samples, config, row) < 1:
        raise SettingsError(
            f"--seq-len {samples} samples are too few for {config.model_type}'s feature encoder (conv_kernel "
            f"{list(config.conv_kernel)}, conv_stride {list(config.conv_stride)}), which makes no frame of them: "
            "give more samples"
        )
    return settings.replace(seq_len=samples)


def _refuse_random_adapter_layers(config: Any, row: SpeechFamily) -> None:
    """An adapter's LayerDrop draws with numpy (modeling_wav2vec2.py, Wav2Vec2Adapter.forward: `layerdrop_prob =
    np.random.random()`, a layer run where it is above `layerdrop`): a real number in the trace too, so the layers the
    estimate ran would be a random draw of its own (a reviewer's find). Refused; with `layerdrop` 0 every layer runs,
    the step that holds the most, as the encoder's own LayerDrop is traced (memplan.estimator.layer_drop)."""
    layerdrop = getattr(config, "layerdrop", 0) or 0
    if row.adapter and getattr(config, "add_adapter", False) and layerdrop > 0:
        raise SettingsError(
            f"{config.model_type}'s adapter drops each of its layers at random (layerdrop {layerdrop}, drawn with "
            'numpy), which would make the estimate a random draw: estimate with "layerdrop": 0.0 in the config, '
            "every layer run (the step that holds the most)"
        )


def _refuse_spec_augment(config: Any) -> None:
    """SpecAugment in training (<Family>Model._mask_hidden_states, modeling_wav2vec2.py: `apply_spec_augment` with
    `mask_time_prob` or `mask_feature_prob` above 0) draws its masked spans with numpy each step and writes them through
    a boolean index (`hidden_states[mask_time_indices] = ...`), whose size no trace without values knows: refused."""
    probabilities = {name: getattr(config, name, 0) or 0 for name in ("mask_time_prob", "mask_feature_prob")}
    masking = {name: value for name, value in probabilities.items() if value > 0}
    if getattr(config, "apply_spec_augment", False) and masking:
        given = ", ".join(f"{name} {value}" for name, value in masking.items())
        raise SettingsError(
            f"{config.model_type}'s SpecAugment ({given}) masks random spans through a boolean index each step, which "
            'memplan cannot size: estimate with it off ("apply_spec_augment": false in the config; its memory is a '
            "boolean mask and an index of the masked frames, small beside the step's)"
        )


def _target_len(config: Any, settings: TrainingSettings) -> int:
    limit = getattr(config, "max_target_positions", None)
    target = settings.target_len or (min(DEFAULT_TARGET_LEN, limit) if limit else DEFAULT_TARGET_LEN)
    if limit is not None and target > limit:
        raise SettingsError(
            f"--target-len {target} is longer than the model's decoder maximum of {limit} positions "
            f"(max_target_positions); use --target-len {limit} or less"
        )
    return target


def speech_batch(config: Any, task: str, settings: TrainingSettings, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The batch a data collator hands the model: full-length audio, labels as valid ids."""
    row = family(config, task)
    if task == "audio-classification":
        return _classifier_batch(config, row, settings, dtype)
    batch, frames, vocab = settings.batch_size, settings.seq_len, config.vocab_size
    if row.inputs == "waveform":
        return {"input_values": torch.randn(batch, frames, dtype=dtype), "labels": _ctc_labels(config, settings)}
    labels = torch.randint(0, vocab, (batch, settings.target_len))
    if row.inputs == "mel-fixed":
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, dtype=dtype), "labels": labels}
    features = config.input_feat_per_channel * config.input_channels
    return {
        "input_features": torch.randn(batch, frames, features, dtype=dtype),
        "attention_mask": torch.ones(batch, frames, dtype=torch.long),
        "labels": labels,
    }


def _classifier_batch(
    config: Any, row: SpeechFamily, settings: TrainingSettings, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The encoder's input, as its feature extractor makes it, and a class per sample in [0, num_labels)."""
    batch, frames = settings.batch_size, settings.seq_len
    labels = torch.randint(0, config.num_labels, (batch,))
    if row.inputs == "mel-fixed":
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, dtype=dtype), "labels": labels}
    if row.inputs == "spectrogram-fixed":
        return {"input_values": torch.randn(batch, frames, config.num_mel_bins, dtype=dtype), "labels": labels}
    return {"input_values": torch.randn(batch, frames, dtype=dtype), "labels": labels}


def _ctc_labels(config: Any, settings: TrainingSettings) -> torch.Tensor:
    """Full rows of ids other than the blank (pad_token_id: the loss masks it out), no id twice in a row (each repeat
    would need a blank frame between: the frames would not suffice), no -100.

    The CTC heads read these values: `labels.max() >= vocab_size` in `<Family>ForCTC.forward`, then the loss
    (ForCTCLoss in transformers/loss/loss_ctc.py, or the head's own lines before it) masks the padding out
    (`masked_select`), counts each row's labels and hands those lengths, with the encoder's frame counts from
    `torch.ones_like(input_values).sum(-1)`, to `F.ctc_loss`, whose `log_alpha` is sized by their largest values.
    Made of Python numbers and kept by the fake mode (memplan.estimator.known_values), they answer each of those reads
    as in a run that trains, through transformers' own code."""
    from memplan.estimator.known_values import keep_values

    blank = config.pad_token_id if config.pad_token_id is not None else 0
    others = max(config.vocab_size - 1, 1)  # the ids that are not the blank, taken in turn

    def label(position: int) -> int:
        nth = position % others
        return nth if nth < blank else nth + 1

    keep_values()
    row = [label(position) for position in range(settings.target_len)]
    return torch.tensor([row] * settings.batch_size, dtype=torch.long)
