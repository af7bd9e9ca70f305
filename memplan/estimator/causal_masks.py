"""torch's transformer modules ask whether a mask is causal by reading its values; under fake tensors, memplan reads
them from the ops that made the mask.

`nn.TransformerEncoder.forward` and `nn.TransformerDecoder.forward` (so `nn.Transformer` too) call
`_detect_is_causal_mask(mask, is_causal, size)` (torch/nn/modules/transformer.py, torch 2.1-2.14) wherever a mask is
given and `is_causal` is not (its default, None): it builds a square causal mask of the mask's dtype and, where the
sizes agree, tests `bool((mask == causal_comparison).all())`. The answer picks the attention path: a causal mask
goes to scaled_dot_product_attention as `is_causal=True` with no mask where no key padding mask is given, any other
mask as a mask. A fake tensor has no values: the trace stopped there ("depends on tensor values ... make that code
shape-only", blaming the user's code) on the usual way to train these modules,
`encoder(x, mask=nn.Transformer.generate_square_subsequent_mask(n))`.

The mask a model makes is made from constants (`torch.full`, `triu`, `ones`, comparisons of `arange`s): the ops the
recorder saw make it are replayed on real tensors, and the test gets its real answer. The comparison's own ops (the
causal mask, `eq`, `all`) run under fake tensors as the real run runs them, so their bytes are counted. A mask whose
values come from elsewhere (the batch, a parameter, a buffer; an index made by `torch.tensor([...])`, whose fake
tensor the recorder keeps without its values) cannot be read: memplan says so and names the hint
that avoids the test, `is_causal=`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from memplan.errors import TraceError
from memplan.estimator.buffer_values import MOST_REPLAYED_ELEMENTS, buffer_value

# How many of the ops that made a mask are replayed at most: a mask is made by a few (a larger ancestry reaches the
# model's activations, which have no real values to replay anyway).
_MOST_OPS = 200


class _NotConstant(Exception):
    """The tensor's values come from something without real values."""


def real_values(
    tensor: torch.Tensor, producers: Mapping[torch.Tensor, Any] | None, recorded: Sequence[Any] | None
) -> torch.Tensor | None:
    """`tensor`'s real values, by replaying on real tensors, in `recorded`'s order (the recorder's nodes), the ops that
    made it, where all of them read only constants; None where some input has no values (the batch, a parameter) or
    nothing was recorded."""
    if producers is None or recorded is None:
        return None
    node = producers.get(tensor)
    if node is None:
        return None
    ancestry: dict[int, Any] = {}
    constants: dict[int, torch.Tensor] = {}
    pending = [node]
    while pending:
        current = pending.pop()
        if id(current) in ancestry:
            continue
        if current.op != "call_function":
            constant = _constant_value(current)
            if constant is None:
                return None
            constants[id(current)] = (
                constant  # a placeholder (the batch), a fake parameter, or a buffer not made of constants
            )
        ancestry[id(current)] = current
        if len(ancestry) > _MOST_OPS:
            return None
        pending.extend(current.all_input_nodes)
    order = {id(each): index for index, each in enumerate(recorded) if id(each) in ancestry}
    if len(order) != len(ancestry):
        return None
    replay = sorted(ancestry.values(), key=lambda each: order[id(each)])
    # each value is let go after the last op that reads it: a mask is positions x positions real values, and the test
    # alone replays two (the mask, torch's causal one) and their makers' intermediates (4 GiB held at 16k positions)
    last_read = {id(each): index for index, current in enumerate(replay) for each in current.all_input_nodes}
    values: dict[int, Any] = {}
    try:
        with _disable_current_modes():
            for index, current in enumerate(replay):
                values[id(current)] = _replayed(current, values, constants)
                for each in current.all_input_nodes:
                    if last_read[id(each)] == index and each is not node:
                        values.pop(id(each), None)
    except (_NotConstant, RuntimeError, TypeError, ValueError):
        return None
    value = values[id(node)]
    if not isinstance(value, torch.Tensor) or value.shape != tensor.shape or value.dtype != tensor.dtype:
        return None
    return value


def _constant_value(node: Any) -> torch.Tensor | None:
    """A constant's real values: a real tensor the step read, a fake one that keeps its values (FakeTensorMode's
    `constant`: `torch.tensor([...])` made under it), or a buffer the model's factory made of constants
    (memplan.estimator.buffer_values); None for anything else (a fake tensor's node keeps the meta
    tensor inside it, memplan.estimator.recorder.alias)."""
    if node.op != "get_attr":
        return None
    value = node.meta.get("val")
    if isinstance(value, FakeTensor):
        return value.constant
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        return value
    if isinstance(value, torch.Tensor):  # a buffer the model's factory made of constants, or a view of one
        return buffer_value(value, MOST_REPLAYED_ELEMENTS)
    return None


def _replayed(node: Any, values: dict[int, Any], constants: dict[int, torch.Tensor]) -> Any:
    if node.op == "get_attr":
        return constants[id(node)].clone()

    def real(argument: Any) -> Any:
        if hasattr(argument, "all_input_nodes") and hasattr(argument, "op"):
            return values[id(argument)]
        if isinstance(argument, FakeTensor):
            raise _NotConstant
        return argument

    args, kwargs = tree_map(real, node.args), tree_map(real, node.kwargs)
    if not callable(node.target):
        raise _NotConstant
    return node.target(*args, **kwargs)


class CausalMaskUnread(TraceError):
    """A mask whose values memplan cannot know, given to a transformer module that tests them."""


@contextlib.contextmanager
def causal_masks_read(
    producers: Mapping[torch.Tensor, Any] | None, recorded: Sequence[Any] | None = None
) -> Iterator[None]:
    """torch.nn.modules.transformer's `_detect_is_causal_mask`, with the values it tests read from the ops that made
    the mask (module docstring). Without `producers` (the untraced runs that make the optimizer state, whose path
    changes no state), a fake mask is taken as not causal."""
    from torch.nn.modules import transformer

    original = getattr(transformer, "_detect_is_causal_mask", None)
    if original is None:
        yield
        return

    def detect_is_causal_mask(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
        if is_causal is not None or not isinstance(mask, FakeTensor):
            return original(mask, is_causal, size)
        # torch's own body (transformer.py), its one value read replaced
        sz = size if size is not None else mask.size(-2)
        causal_comparison = transformer._generate_square_subsequent_mask(sz, device=mask.device, dtype=mask.dtype)
        if mask.size() != causal_comparison.size():
            return False
        equal = (mask == causal_comparison).all()
        if producers is None or recorded is None:
            return False
        value = real_values(equal, producers, recorded) if mask.numel() <= MOST_REPLAYED_ELEMENTS else None
        if value is None:
            raise CausalMaskUnread(
                "torch's nn.TransformerEncoder / nn.TransformerDecoder (nn.Transformer) tests whether the attention "
                "mask it is given is causal by reading its values (torch/nn/modules/transformer.py, "
                "_detect_is_causal_mask), and this mask's values do not come from constants memplan can replay (the "
                "batch, a parameter or a buffer), or it is larger than the 4,096 x 4,096 memplan replays; pass the "
                "module the hint that skips the test: is_causal=True or "
                "False (tgt_is_causal= / src_is_causal= for nn.Transformer and nn.TransformerDecoder)"
            )
        with _disable_current_modes():  # a real tensor's value, read with no mode to see it
            return bool(value)

    with patch.object(transformer, "_detect_is_causal_mask", detect_is_causal_mask):
        yield
