"""The loss transformers' Trainer computes itself where TrainingArguments.label_smoothing_factor is set.

Trainer.compute_loss (transformers 5.x trainer.py), with a LabelSmoother and "labels" in the batch: it pops the
labels, calls the model without them (so the model computes no loss of its own) and runs
`LabelSmoother(epsilon=label_smoothing_factor)` (trainer_pt_utils.py) on the output, with `shift_labels=True`
where the model's class is a causal LM (its name among MODEL_FOR_CAUSAL_LM_MAPPING_NAMES' values; a peft
model's base model's). The smoother's full `log_softmax` over the logits is saved for the backward, beside
the contiguous copy of the shifted logits: memory the model's own cross entropy does not hold. memplan runs
transformers' own LabelSmoother, in the hf-trainer loop (memplan.estimator.loop.micro_batch).

Under amp the Trainer's model is accelerate's prepared one, whose forward is
`convert_outputs_to_fp32(autocast(forward))` (accelerate.Accelerator.prepare_model): the smoother runs after
autocast has closed, on float32 copies of the model's 16-bit outputs (accelerate.utils.convert_to_fp32).
The Trainer turns the smoother off for a model whose config's problem_type is "multi_label_classification"
(Trainer.__init__, with a warning), and uses it only where the batch has "labels". Where the model takes loss
keyword arguments (its `accepts_loss_kwargs`, else a `**kwargs` in its forward: Trainer.__init__), the Trainer
counts the step's labels (`_get_num_items_in_batch`) and hands the count, a 0-d tensor, to the smoother, which
divides by it; otherwise the smoother counts this micro-batch's labels itself, through an int64 copy of its
padding mask.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memplan.errors import SettingsError
from memplan.models.source import Batch


def smooths_labels(model: nn.Module, batch: Batch, label_smoothing: float) -> bool:
    """Whether the Trainer computes this micro-batch's loss with its LabelSmoother (module docstring)."""
    if not label_smoothing or not isinstance(batch, Mapping) or "labels" not in batch:
        return False
    config = getattr(_unwrapped(model), "config", None)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" not in batch:
        # Without labels the decoder has no input: a seq2seq Trainer run gets decoder_input_ids from its collator
        # (DataCollatorForSeq2Seq calls prepare_decoder_input_ids_from_labels), which memplan's batch does not make.
        raise SettingsError(
            "label smoothing on a seq2seq model: the Trainer's decoder then reads the decoder_input_ids that "
            "DataCollatorForSeq2Seq makes, which memplan's batch has not; remove label_smoothing_factor (memplan's "
            "figure is then low by about two float32 logits-sized tensors)"
        )
    return getattr(config, "problem_type", None) != "multi_label_classification"


def without_labels(batch: Mapping[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """The model's inputs and the labels Trainer.compute_loss pops from them."""
    inputs = dict(batch)
    return inputs, inputs.pop("labels")


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model whose class the Trainer names (a peft model's base model: Trainer.compute_loss)."""
    from transformers.trainer_utils import _is_peft_model

    return model.base_model.model if _is_peft_model(model) else model


def shifts_labels(model: nn.Module) -> bool:
    """Trainer.compute_loss's choice of `shift_labels`: the model's class is a causal LM's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return _unwrapped(model)._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def float32_outputs(output: Any) -> Any:
    """The model output as accelerate's amp-prepared forward returns it: 16-bit tensors copied to float32."""
    try:
        from accelerate.utils import convert_to_fp32
    except ImportError as error:  # the Trainer itself cannot run without accelerate
        raise SettingsError(
            "label smoothing under amp is the Trainer's, whose model accelerate prepares: pip install accelerate"
        ) from error
    return convert_to_fp32(output)


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """Trainer.__init__'s model_accepts_loss_kwargs."""
    unwrapped = _unwrapped(model)
    if hasattr(unwrapped, "accepts_loss_kwargs"):
        return bool(unwrapped.accepts_loss_kwargs)
    parameters = inspect.signature(unwrapped.forward).parameters.values()
    return any(parameter.kind == inspect.Parameter.VAR_KEYWORD for parameter in parameters)


def items_in_batch(model: nn.Module, labels: torch.Tensor) -> torch.Tensor | None:
    """The count of labels the Trainer hands the smoother, made before the forward as the Trainer makes it (when
    it fetches the step's batches), or None where it hands none (module docstring). Its value does not change the
    memory: the unshifted labels are counted."""
    from transformers.trainer_pt_utils import LabelSmoother

    return labels.ne(LabelSmoother.ignore_index).sum() if _accepts_loss_kwargs(model) else None


def label_smoothed_loss(
    model: nn.Module, output: Any, labels: torch.Tensor, epsilon: float, num_items_in_batch: torch.Tensor | None
) -> torch.Tensor:
    """transformers' LabelSmoother over the output, labels shifted as the Trainer decides (module docstring)."""
    from transformers.trainer_pt_utils import LabelSmoother

    smoother = LabelSmoother(epsilon=epsilon)
    return smoother(output, labels, shift_labels=shifts_labels(model), num_items_in_batch=num_items_in_batch)
