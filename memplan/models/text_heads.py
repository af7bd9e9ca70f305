"""Three more text heads people fine-tune: token classification (NER, POS), extractive question answering (SQuAD)
and multiple choice (SWAG). Each is a transformers auto class over the same encoder (or decoder) as the other text
tasks, with the batch its data collator hands it; --seq-len is its tokens (per choice, for multiple choice), limited
by the model's positions as for the other text tasks (memplan.models.batches.resolve_lengths).

- `token-classification` (AutoModelForTokenClassification): input_ids [batch, seq] and labels [batch, seq], a class
  id per token in [0, num_labels) (DataCollatorForTokenClassification pads them with -100, which a full-length
  batch has no place for). The loss: ForTokenClassification (transformers/loss/loss_utils.py), or the head's own
  CrossEntropyLoss over `logits.view(-1, num_labels)` (BERT, DeBERTa-v2, ModernBERT).
- `question-answering` (AutoModelForQuestionAnswering): input_ids [batch, seq], start_positions and end_positions
  [batch], token positions in [0, seq). The loss (ForQuestionAnsweringLoss, loss_utils.py, or the head's own, as
  DeBERTa-v2's) clamps them to [0, seq] and ignores `ignored_index = start_logits.size(1)` (seq): an answer
  truncated out of the window. Memplan's positions are all inside it, so every row counts.
- `multiple-choice` (AutoModelForMultipleChoice): input_ids [batch, DEFAULT_NUM_CHOICES, seq] and labels [batch],
  the right choice's index, as DataCollatorForMultipleChoice (transformers/data/data_collator.py) makes them; the
  head flattens the choices into the encoder's batch (`input_ids.view(-1, input_ids.size(-1))`) and scores them
  (`logits.view(-1, num_choices)`, BertForMultipleChoice.forward in modeling_bert.py).
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.errors import SettingsError
from memplan.settings import TrainingSettings

TEXT_HEAD_TASKS = ("token-classification", "question-answering", "multiple-choice")

# The auto class that builds each head, and its mapping in transformers.models.auto.modeling_auto (whose model types
# the task is offered for, and guessed in this order after the other tasks: memplan.models.hf).
AUTO_CLASSES = {
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "multiple-choice": "AutoModelForMultipleChoice",
}
MAPPINGS = {
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "multiple-choice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
}
# A config's `architectures` naming a class of a model type the mapping does not hold (a subclass of one's own).
ARCHITECTURE_SUFFIXES = {
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForMultipleChoice": "multiple-choice",
}

# SWAG's four candidate endings per context (transformers' examples/pytorch/multiple-choice/run_swag.py:
# `ending_names = [f"ending{i}" for i in range(4)]`), the multiple-choice benchmark transformers' own recipe trains;
# memplan has no setting for it (the step is the encoder's over batch x choices sequences).
DEFAULT_NUM_CHOICES = 4


def check_text_head(config: Any, task: str) -> None:
    """A question-answering head scores each token as an answer's start and end: its `qa_outputs` has num_labels
    outputs, split in two (`logits.split(1, dim=-1)`, BertForQuestionAnswering.forward), and any other count fails in
    the real run ("too many values to unpack"): refused in one line."""
    if task == "question-answering" and getattr(config, "num_labels", 2) != 2:
        raise SettingsError(
            f"a question-answering head scores a start and an end (num_labels 2); this config has num_labels "
            f"{config.num_labels}: set it to 2"
        )


def text_head_batch(config: Any, task: str, settings: TrainingSettings) -> dict[str, torch.Tensor]:
    """Full-length, unpadded batches (no attention mask), targets as each head's collator makes them."""
    batch, seq = settings.batch_size, settings.seq_len
    vocab = getattr(config, "vocab_size", 2)
    if task == "token-classification":
        return {
            "input_ids": torch.randint(0, vocab, (batch, seq)),
            "labels": torch.randint(0, config.num_labels, (batch, seq)),
        }
    if task == "question-answering":
        return {
            "input_ids": torch.randint(0, vocab, (batch, seq)),
            "start_positions": torch.randint(0, seq, (batch,)),
            "end_positions": torch.randint(0, seq, (batch,)),
        }
    if task == "multiple-choice":
        return {
            "input_ids": torch.randint(0, vocab, (batch, DEFAULT_NUM_CHOICES, seq)),
            "labels": torch.randint(0, DEFAULT_NUM_CHOICES, (batch,)),
        }
    raise AssertionError(f"unknown text head task {task}")
