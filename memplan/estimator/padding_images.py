"""Idefics2's, Idefics3's and SmolVLM's padding images, found by their pixels' values, answered as memplan's batch has
them: none.

`get_image_features` (transformers/models/idefics2/modeling_idefics2.py, idefics3/modeling_idefics3.py,
smolvlm/modeling_smolvlm.py, 5.17-5.25) drops the images a processor padded a sample's image list with, which are all
zeros:

    real_images_inds = (pixel_values == 0.0).sum(dim=(-1, -2, -3)) != nb_values_per_image
    pixel_values = pixel_values[real_images_inds].contiguous()
    ... image_features.split(num_real_images_per_batch.tolist())

Under fake tensors the pixels have no values, and the boolean index (`nonzero`) and `.tolist()` are refused as
data-dependent. memplan.models.vision_language_tiles gives every sample real images only (one, or its tiles and the
whole image: random pixels, never all zero), so each image is real: while a step is traced that comparison, made where
the model's own `get_image_features` compares, carries that answer (all true) as its values
(memplan.estimator.known_values), which the index, count and split then read as in the real run. Its ops run as ever
(the comparison's boolean tensor and the sum's, counted); only the answer is given.

The same function then marks the patches that hold any pixel of `pixel_attention_mask` (`patch_attention_mask =
(patches_subgrid.sum(dim=(-1, -2)) > 0).bool()`; Idefics2's those whose pixels all are, `== patch_size * patch_size`),
which the vision tower's attention mask is made from, skipped where all are true (memplan.estimator.hf_patches; so is
Idefics2's perceiver's, the latents' ones beside them). memplan's mask is all ones, so every patch is real: that `>`
(`==`: the integer counts only, not the pixels' `== 0.0`, whose count `!=` answers) is
answered all true too. Its values had come through from the mask's own (`torch.ones`), but only while the mask had
at most buffer_values.MOST_REPLAYED_ELEMENTS elements (the values memplan keeps): past it (a 512-pixel SmolVLM tile
beyond batch 64) the trace built the float mask a real run skips, and the peak jumped by 2.4% at that batch size.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch

# (module, class) whose `get_image_features` finds padding images by comparing their zero count with `!=`.
_PADDING_IMAGE_FINDERS = (
    ("transformers.models.idefics2.modeling_idefics2", "Idefics2Model"),
    ("transformers.models.idefics3.modeling_idefics3", "Idefics3Model"),
    ("transformers.models.smolvlm.modeling_smolvlm", "SmolVLMModel"),
)


def _finding_codes() -> frozenset[Any]:
    """The code objects of the loaded models' `get_image_features`, their decorators unwrapped."""
    codes = set()
    for module_name, class_name in _PADDING_IMAGE_FINDERS:
        module = sys.modules.get(module_name)
        found = getattr(getattr(module, class_name, None), "get_image_features", None)
        if found is not None:
            codes.add(inspect.unwrap(found).__code__)
    return frozenset(codes)


@contextlib.contextmanager
def no_padding_images() -> Iterator[None]:
    """While a step is traced: the real-image comparison answers all true (module docstring)."""
    codes = _finding_codes()
    if not codes:
        yield
        return

    def answered_true(original: Any) -> Any:
        def compared(self: torch.Tensor, other: Any) -> Any:
            out = original(self, other)
            if (
                sys._getframe(1).f_code in codes
                and not self.dtype.is_floating_point  # (counts: not the pixels' `== 0.0`, whose count `!=` answers)
                and isinstance(out, FakeTensor)
                and out.dtype == torch.bool
                and getattr(out.fake_mode, "keeps_values", False)
            ):
                with no_dispatch():  # (a real tensor, made outside the modes the step is traced under)
                    out.constant = torch.ones(out.shape, dtype=torch.bool)
            return out

        return compared

    with (
        patch.object(torch.Tensor, "__ne__", answered_true(torch.Tensor.__ne__)),
        patch.object(torch.Tensor, "__gt__", answered_true(torch.Tensor.__gt__)),
        patch.object(torch.Tensor, "__eq__", answered_true(torch.Tensor.__eq__)),
    ):
        yield
