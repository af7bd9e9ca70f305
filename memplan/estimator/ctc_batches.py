"""A CTC head's loss over memplan's own batch, traced as the real run computes it.

transformers' CTC heads (Wav2Vec2ForCTC and its kin, AutoModelForCTC) read their labels' values twice:
`<Family>ForCTC.forward` checks `if labels is not None and labels.max() >= self.config.vocab_size: raise
ValueError`, and `ForCTCLoss` (transformers/loss/loss_ctc.py, 5.x) drops the padding with
`labels.masked_select((labels != ignore_index) & (labels != blank_token_id))`, counts each row's labels
(`labels_mask.sum(-1)`) and hands those lengths and the encoder's frame counts to `F.ctc_loss` as tensors, whose
`log_alpha` is sized by their largest values. Under fake tensors none of these values exist, and the step was
refused as data-dependent. For the labels memplan made itself (memplan.models.speech: full rows of ids, none the
blank, no -100; no attention mask, so every sample's frames are the logits' length) the values are known: while a
step is traced the check reads False, as in a run that trains, and ForCTCLoss runs op by op as transformers writes
it (a copy of its few lines, taken only for memplan's own labels: tests/test_models_speech.py measures the real runs
with transformers' own, so a release that changes it shows there), its mask and its two length tensors carrying
those values (a fake tensor's `constant`, which memplan.estimator.oprules.masked and .ctc read). Labels from
anywhere else are left as they are (refused as before).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memplan.models.speech import is_full_ctc_labels


def _known(tensor: torch.Tensor, value: int | bool) -> None:
    """Give a fake tensor its values (all `value`), made outside every mode: a real tensor."""
    with _disable_current_modes():
        tensor.constant = torch.full(tuple(tensor.shape), value, dtype=tensor.dtype)


def _ctc_loss_of(original: Any) -> Any:
    def ctc_loss(
        logits: torch.Tensor,
        labels: torch.Tensor,
        logit_lengths: torch.Tensor,
        blank_token_id: int,
        reduction: str = "mean",
        zero_infinity: bool = False,
        ignore_index: int = -100,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not (isinstance(logits, FakeTensor) and is_full_ctc_labels(labels) and logits.dim() == 3):
            return original(
                logits, labels, logit_lengths, blank_token_id, reduction, zero_infinity, ignore_index, **kwargs
            )
        # ForCTCLoss (transformers/loss/loss_ctc.py), line by line, with the values memplan's batch has.
        labels = labels.to(logits.device)
        labels_mask = (labels != ignore_index) & (labels != blank_token_id)
        _known(labels_mask, True)  # no -100, no blank: every label kept
        target_lengths = labels_mask.sum(-1)
        _known(target_lengths, labels.size(-1))
        flattened_targets = labels.masked_select(labels_mask)
        if isinstance(logit_lengths, FakeTensor) and getattr(logit_lengths, "constant", None) is None:
            _known(logit_lengths, logits.size(1))  # no attention mask: every sample's frames, the logits' length
        log_probs = nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
        with torch.backends.cudnn.flags(enabled=False):
            return nn.functional.ctc_loss(
                log_probs,
                flattened_targets,
                logit_lengths,
                target_lengths,
                blank=blank_token_id,
                reduction=reduction,
                zero_infinity=zero_infinity,
            )

    return ctc_loss


def _answered(caller: Any) -> bool:
    """Whether a `bool()` read in `caller` (a frame) is one this module answers False (module docstring): the label
    check of a CTC head's forward over memplan's labels. (LayerDrop's draws are memplan.estimator.layer_drop's.)"""
    if caller.f_code.co_name != "forward":
        return False
    module = type(caller.f_locals.get("self")).__name__
    return module.endswith("ForCTC") and is_full_ctc_labels(caller.f_locals.get("labels"))


def _label_check_passing(plain: Any) -> Any:
    """`bool()` of a fake tensor, answered where _answered says so, else as before (refused as data-dependent)."""

    def bool_(self: torch.Tensor) -> bool:
        return False if _answered(sys._getframe(1)) else plain(self)

    return bool_


@contextlib.contextmanager
def full_ctc_batches() -> Iterator[None]:
    loss_utils = sys.modules.get("transformers.loss.loss_utils")
    mapping = getattr(loss_utils, "LOSS_MAPPING", None)
    if not isinstance(mapping, dict) or "ForCTC" not in mapping:
        yield  # no CTC head built (or a transformers without ForCTCLoss): nothing to answer
        return
    with (
        patch.dict(mapping, {"ForCTC": _ctc_loss_of(mapping["ForCTC"])}),
        patch.object(FakeTensor, "__bool__", _label_check_passing(FakeTensor.__bool__), create=True),
    ):
        yield
