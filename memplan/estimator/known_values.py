"""Values a traced step keeps: what is made of Python numbers, and what ops over such tensors alone compute.

Under fake tensors no tensor has values, and a model that reads some is refused as data-dependent. torch's fake mode
keeps one kind (fake_tensor.py, `_dispatch_impl`): a tensor made from Python numbers (`torch.tensor(...)`, a lift)
carries its real values as its `constant`, and an op whose fake arguments all carry theirs runs for real on them, its
result a constant in turn, where it has one element (CONSTANT_NUMEL_LIMIT); reads of one (`bool()`, `int()`,
`_local_scalar_dense`) answer its value. A batch memplan made of values it knows asks for more (`keep_values`):
memplan.models.speech's CTC labels (which the heads check against the vocabulary, mask, count and hand
`F.ctc_loss` as lengths, with the frames counted from `torch.ones_like(input_values)`), and
memplan.models.vision_language's token ids, token types and image grids, which an image-text model reads to place
the image's features (`input_ids == image_token_id`, its count checked against the features', `masked_scatter`,
whose backward's `masked_select` is sized by the mask: memplan.estimator.oprules.masked) and to compute positions
(Qwen2-VL's `get_rope_index`: `.tolist()`, `.item()`, `torch.arange`, `torch.tensor` of them). From then on the
TracingFakeMode keeps (a) results of up to MOST_REPLAYED_ELEMENTS elements (memplan.estimator.buffer_values' bound
on real values made in this process), (b) the outputs of factories of values (VALUE_FACTORIES: what they make is
known from their arguments; SHAPED_VALUE_FACTORIES, from their tensor's sizes), and (c) `torch.tensor` of a list of
fake tensors that carry values is made of them
(`tensors_of_values`). A tensor made otherwise (a parameter, random pixels, anything computed from one) has no
values, as before: the model's arithmetic is traced as ever, and only reads of the batch's layout are answered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensor

# Factories of values (buffer_values' constants, whose values it replays): what they make is known from their
# arguments. Not `empty` and its kin (whatever memory held) nor random ones.
VALUE_FACTORIES = frozenset(
    {
        torch.ops.aten.arange.default,
        torch.ops.aten.arange.start,
        torch.ops.aten.arange.start_step,
        torch.ops.aten.zeros.default,
        torch.ops.aten.ones.default,
        torch.ops.aten.full.default,
        torch.ops.aten.scalar_tensor.default,
    }
)
# Factories of values shaped like a tensor: what they make is known from its sizes, strides and dtype, not its values
# (a CTC head's `torch.ones_like(input_values, dtype=torch.long)`, whose row sums are the frames it counts).
SHAPED_VALUE_FACTORIES = frozenset(
    {torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default, torch.ops.aten.full_like.default}
)


def keep_values() -> None:
    """Let the active TracingFakeMode (memplan.estimator.fake_mode), if any, keep values from now on (module
    docstring). A batch made of values memplan knows calls it as it is made; other traces keep torch's one-element
    constants only."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is not None and hasattr(mode, "keeps_values"):
        mode.keeps_values = True


def _values_of(data: Any) -> Any:
    """`data` (what `torch.tensor` is given) with each fake tensor whose values the mode keeps in their place; None
    where it holds none."""
    if isinstance(data, FakeTensor):
        return data.constant if getattr(data.fake_mode, "keeps_values", False) else None
    if isinstance(data, list | tuple) and any(isinstance(item, FakeTensor | list | tuple) for item in data):
        items = [_values_of(item) for item in data]
        if any(new is not None for new in items):
            return type(data)(item if new is None else new for item, new in zip(data, items, strict=True))
    return None


def _tensor_of_values(plain: Any) -> Any:
    """`torch.tensor(data)` where `data` holds fake tensors whose values the mode keeps: made of those values, as the
    real run reads its elements' (torch/csrc/utils/tensor_new.cpp, `recursive_store`, copies each element's memory,
    which a fake tensor has none of: "its data is not allocated yet"). Qwen2-VL's get_rope_index makes its position
    deltas so, `torch.tensor([positions.max() + 1 - length, ...])` (modeling_qwen2_vl.py). Any other call is left as
    it was."""

    def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        values = _values_of(data)
        return plain(data if values is None else values, *args, **kwargs)

    return tensor


@contextlib.contextmanager
def tensors_of_values() -> Iterator[None]:
    """While a step is traced: `torch.tensor` of fake tensors that carry values (_tensor_of_values), and their
    `.tolist()` answered from those values (_listed_values)."""
    with (
        patch.object(torch, "tensor", _tensor_of_values(torch.tensor)),
        patch.object(FakeTensor, "tolist", _listed_values(FakeTensor.tolist)),
    ):
        yield


def _listed_values(plain: Any) -> Any:
    """`.tolist()` of a fake tensor whose values the mode keeps: its values, as the real run's. torch's own
    (FakeTensor.tolist, fake_tensor.py) unbinds the tensor and reads each element with `.item()`, one fake tensor and
    one recorded op per element: Qwen2-VL's get_rope_index lists each row's token types, and at 8,192 tokens the
    graph had 35,060 nodes and took 26 s to simulate, 2,233 nodes and under 5 s with the values listed (a reviewer's
    measurement)."""

    def tolist(self: FakeTensor) -> Any:
        if self.constant is not None and getattr(self.fake_mode, "keeps_values", False):
            return self.constant.tolist()
        return plain(self)

    return tolist
