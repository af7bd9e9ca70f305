"""The math path of scaled_dot_product_attention holds its casts and its converted mask until it returns.

Where no fused kernel takes the call (on the CPU with dropout, whose flash kernel has none; on CUDA where
memplan.estimator.cuda.kernels picks "math"), `scaled_dot_product_attention` runs
`_scaled_dot_product_attention_math`, one C++ function (aten/src/ATen/native/transformers/attention.cpp,
torch 2.11-2.14). Its variables hold, until it returns:
- `query_acc`, `key_acc`, `value_acc`: float32 copies of a 16-bit query, key and value ("keep query, key, value
  in high precision for accuracy"), read by no op after the scaling and the products;
- `attn_mask`: a boolean mask converted to an additive one (`convert_boolean_attn_mask`, an `aten.where`), and
  for `is_causal` the causal mask it builds;
- `query`, the scaled query (`query_acc * scaling_factor`); the scaled key's transpose, a temporary of the
  first product's statement, lives through that product;
- the attention weights cast back to the input's dtype (`attn.to(origin_dtype)`), returned beside the output
  in a tuple whose caller keeps only the output: no op ever reads them.
memplan had freed each after its last read (the weights at once): two attention blocks with dropout under CPU
autocast were 7.4% low against their real CPU run, 18.3% checkpointed (`tests/test_math_attention.py`).
The mask is added to the scores in place, `attn.add_(*attn_mask)`, unless `at::areAnyTensorSubclassLike({attn,
*attn_mask})`, which a fake tensor (and any tensor under a dispatch mode) is: memplan's trace ran `attn.add(mask)`,
one scores-sized request more per call than a plain run makes (the H100 traces of qwen2.5-0.5b-fp32 with the math
path: 448 MiB a layer). `plain_attention_op` runs the plain path's `add_` on the product the call has just made.
Recognised by the ops one call ran: the math path is the one that runs `aten._safe_softmax`; what it holds are the
outputs of its casts (`_to_copy`), of `where` and of its first scalar product, through the call's last op, and of
its second scalar product through the first `bmm`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from memplan.estimator.composites import CompositeOp, CompositeWatcher, added_in_place, plain_path_patched

_SAFE_SOFTMAX = torch.ops.aten._safe_softmax.default
_HELD_OUTPUTS = frozenset({torch.ops.aten._to_copy.default, torch.ops.aten.where.self})
_MUL_SCALAR, _BMM = torch.ops.aten.mul.Scalar, torch.ops.aten.bmm.default


def held_by_math_attention(
    ops: list[CompositeOp], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
) -> list[tuple[object, int]]:
    """(storage, the last node it lives through) for what one scaled_dot_product_attention call's math path held
    (module docstring); nothing where a fused kernel ran it."""
    if not any(op.func is _SAFE_SOFTMAX for op in ops):
        return []
    end = ops[-1].end
    held = [(storage, end) for op in ops if op.func in _HELD_OUTPUTS for storage in op.output_storages]
    scalings = [index for index, op in enumerate(ops) if op.func is _MUL_SCALAR][:2]
    if scalings:  # `const auto query = query_acc * scaling_factor`: a variable until the function returns
        held += [(storage, end) for storage in ops[scalings[0]].output_storages]
    if len(scalings) == 2:  # `key_acc.transpose(-2, -1) * scaling_factor`: a temporary of the first product's statement
        product = next((op.end for op in ops[scalings[1] + 1 :] if op.func is _BMM), end)
        held += [(storage, product) for storage in ops[scalings[1]].output_storages]
    return held


def plain_attention_op(func: Any, args: tuple[Any, ...], ops: list[CompositeOp]) -> Any:
    """The op the math path's plain run calls for `func`: `attn.add_(*attn_mask)` for the subclass path's
    `attn.add(*attn_mask)`, on the scores the call's product has just made, before its softmax."""
    if any(op.func is _SAFE_SOFTMAX for op in ops):
        return func
    return added_in_place(func, args, ops)


@contextlib.contextmanager
def math_attention_tracked(watcher: CompositeWatcher) -> Iterator[None]:
    """While a step is traced, F.scaled_dot_product_attention (on a cuda target, memplan's emulation of CUDA's,
    patched in before this) is watched: what each call's math path held until it returned, and its mask added in
    place as a plain run adds it."""
    with plain_path_patched(watcher, F, "scaled_dot_product_attention", plain_attention_op, held_by_math_attention):
        yield
