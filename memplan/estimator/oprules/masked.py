"""`masked_select` where memplan has the mask's values: its output's length is the mask's count of trues.

aten/src/ATen/native/TensorAdvancedIndexing.cpp (torch 2.11-2.14), `masked_select_cpu` / `masked_select_out_impl_cpu`:
the mask and the input broadcast to one shape, the output a 1-D tensor of the input's dtype, as long as the mask has
trues. The op carries the `dynamic_output_shape` tag, so a fake tensor mode refuses it; a mask whose values memplan
knows (a fake tensor's `constant`: memplan.estimator.known_values keeps the padding mask of memplan's own CTC labels,
all true, and an image-text batch's placeholder mask) gets its output here; any other mask is refused as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from memplan.estimator.oprules import OutputLayout, fake_kernel_rule


def known_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """The mask's values where memplan has them (a fake tensor's `constant`), else None."""
    constant = getattr(mask, "constant", None)
    return constant if isinstance(constant, torch.Tensor) and constant.shape == mask.shape else None


@fake_kernel_rule(torch.ops.aten.masked_select.default)
def masked_select(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OutputLayout:
    source = args[0] if args else kwargs["self"]
    mask = args[1] if len(args) > 1 else kwargs["mask"]
    values = known_mask(mask)
    if values is None:
        raise DynamicOutputShapeException(torch.ops.aten.masked_select.default)
    shape = torch.broadcast_shapes(source.shape, mask.shape)
    count = int(values.expand(shape).sum())
    return [count], [1], source.dtype
