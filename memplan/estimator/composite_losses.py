"""Loss functions that run as one C++ composite hold their variables, and autocast's casts of their arguments,
until they return.

Each of these `torch.nn.functional` losses calls one ATen function, a CompositeImplicitAutograd kernel in
aten/src/ATen/native/Loss.cpp (torch 2.11-2.14) that calls many ops; memplan sees the ops, not the C++ variables
(memplan.estimator.composites):
- `hinge_embedding_loss`: `zeros`, `margin_clamp` (`margin - self`, clamped in place), `output_margin`,
  `output_self` and `output` are variables: every tensor it makes lives until it returns.
- `margin_ranking_loss`: `(-target * (input1 - input2) + margin)` is one statement: its temporaries (the
  difference) live until it ends, with the `add`.
- Under autocast, an op on autocast's float32 list is called with its arguments cast to float32
  (autocast_mode.h, `WrapFunction_<CastPolicy::fp32, ...>`: `cached_cast(...)` in the call's argument list),
  temporaries that live until the op returns; for a composite that is after all its ops. `kl_div` is one:
  `at::xlogy(target, target) - target * input`, after which the cast input had been freed at its last read;
  `cross_entropy` another: its log_softmax reads the cast, its nll_loss runs with it held.
- `triplet_margin_loss`: the two distances are variables and its last statement's temporaries live with it.
memplan had freed each at its last read: a hinge embedding loss was 21% low, a margin ranking loss 11% and
`kl_div` under CPU autocast 11.5%, a triplet margin loss under it 19% against their real CPU runs (a helper's bug hunt;
`tests/test_composite_losses.py`).

`ctc_loss` (aten/src/ATen/native/LossCTC.cpp, `ctc_loss_impl`) with reduction='mean' and lengths given as Python ints
divides by `at::tensor(target_lengths, res.options()).clamp_min(1)`: `at::tensor` is an `at::empty` whose data the
C++ code writes directly, which a fake tensor has none of, so tracing failed ("data is not allocated yet"). While a
step is traced, `torch.ctc_loss` (what `F.ctc_loss` and `nn.CTCLoss` call) runs that mean in Python, op for op as
the C++ does: the unreduced loss (`res`), the `empty` of the lengths, its `clamp_min` (the `empty` a temporary of
that statement), then `(res / target_lengths_t).mean()`, `res` and `target_lengths_t` variables held to the return.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import torch
import torch.nn.functional as F

from memplan.estimator.composites import CompositeOp, CompositeWatcher, HeldRule, watched
from memplan.estimator.eager_lifetimes import storage_key
from memplan.estimator.leaves import tensors_in

_TO_COPY = torch.ops.aten._to_copy.default
_ADDS = (torch.ops.aten.add.Scalar, torch.ops.aten.add.Tensor)
_NORMS = (torch.ops.aten.norm.ScalarOpt_dim, torch.ops.aten.linalg_vector_norm.default)


def _argument_casts(ops: list[CompositeOp], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[object, int]]:
    """The casts of the call's own tensor arguments (autocast's), through the call's last op."""
    arguments = {storage_key(tensor) for tensor in tensors_in((args, kwargs))}
    end = ops[-1].end
    return [
        (storage, end)
        for op in ops
        if op.func is _TO_COPY and op.argument_storage in arguments
        for storage in op.output_storages
    ]


def _held_by_casts(ops: list[CompositeOp], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[object, int]]:
    return _argument_casts(ops, args, kwargs) if ops else []


def _held_by_hinge_embedding(
    ops: list[CompositeOp], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[object, int]]:
    if not ops:
        return []
    end = ops[-1].end
    return [(storage, end) for op in ops for storage in op.output_storages]


def _held_by_margin_ranking(
    ops: list[CompositeOp], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[object, int]]:
    if not ops:
        return []
    add = next((index for index, op in enumerate(ops) if op.func in _ADDS), len(ops) - 1)  # `... + margin`
    held = [(storage, ops[add].end) for op in ops[: add + 1] for storage in op.output_storages]
    return held + _argument_casts(ops, args, kwargs)


def _held_by_triplet_margin(
    ops: list[CompositeOp], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[object, int]]:
    """Each `pairwise_distance` is one statement, `return at::norm(x1 - x2 + eps, ...)`: what it makes lives
    through its norm. `dist_pos` and `dist_neg` (the norms) are variables, and `margin + dist_pos - dist_neg` is
    the statement that returns: they live to the end."""
    if not ops:
        return []
    end, held, statement_start = ops[-1].end, [], 0
    for index, op in enumerate(ops):
        if op.func in _NORMS:
            held += [(storage, op.end) for made in ops[statement_start:index] for storage in made.output_storages]
            held += [(storage, end) for storage in op.output_storages]
            statement_start = index + 1
    held += [(storage, end) for made in ops[statement_start:] for storage in made.output_storages]
    return held + _argument_casts(ops, args, kwargs)


# The losses watched, by name in torch.nn.functional, and what each holds (module docstring). Those with only
# the casts' rule are composites on autocast's float32 list whose own temporaries die where memplan frees them.
WATCHED_LOSSES: dict[str, HeldRule] = {
    "hinge_embedding_loss": _held_by_hinge_embedding,
    "margin_ranking_loss": _held_by_margin_ranking,
    "kl_div": _held_by_casts,
    # `cross_entropy_loss` (Loss.cpp: `at::nll_loss_nd(at::log_softmax(self, ...), ...)`) is on autocast's float32
    # list (autocast_mode.cpp, CPU's and CUDA's): 16-bit logits' float32 copy lives through the nll_loss, where memplan
    # had freed it after the log_softmax (a segmentation head's amp-bf16 step 8 B low, its peak at the nll_loss;
    # tests/test_composite_losses.py). A causal LM's loss casts its logits itself first (`logits.float()`): no cast.
    "cross_entropy": _held_by_casts,
    "triplet_margin_loss": _held_by_triplet_margin,
}


_MEAN, _NONE = 1, 0  # at::Reduction


def _ctc_loss_traced(ctc_loss: Any) -> Any:
    """`torch.ctc_loss` whose mean over Python-int target lengths runs in Python (module docstring)."""

    def run(
        log_probs: torch.Tensor,
        targets: torch.Tensor,
        input_lengths: Any,
        target_lengths: Any,
        blank: int = 0,
        reduction: int = _MEAN,
        zero_infinity: bool = False,
    ) -> torch.Tensor:
        if reduction != _MEAN or isinstance(target_lengths, torch.Tensor):  # a tensor's: `clamp_min`, no data write
            return ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        res = ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, _NONE, zero_infinity)
        target_lengths_t = torch.empty(len(target_lengths), dtype=res.dtype, device=res.device).clamp_min(1)
        return (res / target_lengths_t).mean()

    return run


@contextlib.contextmanager
def composite_losses_tracked(watcher: CompositeWatcher) -> Iterator[None]:
    """While a step is traced, the losses of WATCHED_LOSSES are watched, and ctc_loss's mean runs in Python."""
    with contextlib.ExitStack() as stack:
        for name, held in WATCHED_LOSSES.items():
            stack.enter_context(patch.object(F, name, watched(watcher, getattr(F, name), held)))
        stack.enter_context(patch.object(torch, "ctc_loss", _ctc_loss_traced(torch.ctc_loss)))
        yield
