"""Backward formulas run as a plain run runs them, while a dispatch mode watches.

Many of torch's backward formulas have two paths: an in-place one (`zeros.scatter_add_(...)`), and an
out-of-place one (`zeros.scatter_add(...)`, which copies the buffer it was given) for tensor subclasses. Which
one runs is decided by `at::isTensorSubclassLike` / `at::areAnyTensorSubclassLike`
(aten/src/ATen/TensorSubclassLikeUtils.h, torch 2.11-2.14), which answer true for a FakeTensor, a meta tensor,
and for every tensor while any Python dispatch mode is active (`c10::impl::dispatch_mode_enabled()`). So
memplan's trace (fake tensors under modes) and its CPU counter (memplan.measure.cpu.LiveStorageCounter, a mode)
saw the out-of-place path, one output-sized buffer more than a plain run holds while the formula runs: a loss
that gathers from a [tokens, vocabulary] tensor (a DPO or RL log-probability) over-predicted by a whole
vocabulary-sized buffer, `topk` or `max(dim)` over a wide output by +82% on a tiny model
(tests/test_plain_formulas.py, against the CPU allocator's own events, which no mode perturbs).

Each rule here, keyed by the autograd Node whose formula has such a branch, gives the op the plain run calls
for the op the subclass path called. Both memplan's trace and its CPU counter call `PlainFormulaPaths.op_for`
before running an op inside a backward formula, so each runs the plain path: in place, on the buffer the formula
itself made (the values are the same: the real counter's run computes what a plain run does).
Sources, torch 2.11-2.14: `gather_backward`, `index_select_backward_symint`, `masked_select_backward`
(aten/src/ATen/native/TensorAdvancedIndexing.cpp), `value_selecting_reduction_backward_symint`,
`cummaxmin_backward` (aten/src/ATen/native/ReduceOps.cpp), `index_backward`, `take_backward`,
`binary_cross_entropy_with_logits_backward` (torch/csrc/autograd/FunctionsManual.cpp), `trace_backward_symint`
(aten/src/ATen/native/TriangularOps.cpp); Node names from tools/autograd/derivatives.yaml.

Left as the subclass path runs them (over-predicting, never under): formulas whose plain path is another
algorithm (`prod_backward` and `cumprod_backward` test for zeros with `.item()`; `evenly_distribute_backward`,
the gradient of a full `max()`/`min()`/`median()`, runs `masked_fill_` on the CPU), `clamp` with tensor bounds
(a boolean mask combined in place), and the target's gradient of the binary cross-entropies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memplan.estimator.leaves import tensors_in

aten = torch.ops.aten

# The formula's one out-of-place op, on a buffer it has just made (new_zeros / zeros / zeros_like), and the
# in-place op the plain path calls instead (only on a buffer the formula made).
_ON_FRESH_BUFFER: dict[str, dict[Any, Any]] = {
    # gather_backward: `result.scatter_add_(dim, index, grad)` on `grad.new_zeros_symint(self.sym_sizes())`
    # (take_along_dim runs gather).
    "GatherBackward0": {aten.scatter_add.default: aten.scatter_add_.default},
    # index_select_backward_symint: `grad.new_zeros_symint(self_sizes, ...).index_add_(dim, index, grad)`
    "IndexSelectBackward0": {aten.index_add.default: aten.index_add_.default},
    # cummaxmin_backward: `result.scatter_add_(dim, indices, grad)` on `at::zeros_symint(input.sym_sizes(), ...)`
    "CummaxBackward0": {aten.scatter_add.default: aten.scatter_add_.default},
    "CumminBackward0": {aten.scatter_add.default: aten.scatter_add_.default},
    # masked_select_backward: `result.masked_scatter_(mask, grad)` on `at::zeros_like(input.expand(...))`
    "MaskedSelectBackward0": {aten.masked_scatter.default: aten.masked_scatter_.default},
    # index_backward: `at::_index_put_impl_(zeros_like_self, indices, grad, true, true)`, the buffer made by the
    # derivatives.yaml formula (`grad.new_zeros_symint(self.sym_sizes(), self.options())`); index_put_ is the same
    # op with unsafe=false.
    "IndexBackward0": {aten.index_put.default: aten.index_put_.default},
    # take_backward: `grad_self.put_(indices, grad, true)` on `at::zeros_like(self)`
    "TakeBackward0": {aten.put.default: aten.put_.default},
    # trace_backward_symint: `grad_input.index_fill_(0, indices, grad)` on `at::zeros_symint(...)`
    "TraceBackward0": {aten.index_fill.int_Tensor: aten.index_fill_.int_Tensor},
}
# value_selecting_reduction_backward_symint: `grad_in.scatter_(dim, indices_, grad_out)` on `at::zeros_symint`,
# for every reduction that selects values by index.
for _node in (
    "MaxBackward0",  # max.dim
    "MinBackward0",  # min.dim
    "TopkBackward0",
    "SortBackward0",
    "SortBackward1",  # sort.stable
    "KthvalueBackward0",
    "MedianBackward1",  # median.dim
    "NanmedianBackward1",  # nanmedian.dim
    "ModeBackward0",
):
    _ON_FRESH_BUFFER[_node] = {aten.scatter.src: aten.scatter_.src}

# binary_cross_entropy_with_logits_backward's plain path: `input.sigmoid().sub_(target)` (with pos_weight:
# `t.add(1).sub_(target).mul_(input.sigmoid()).sub_(t)`, where `t = pos_weight->mul(target)` is out of place in
# both), then `grad_input.mul_(grad)` and `grad_input.mul_(*weight)`: each in place on the formula's own result.
_BCE_WITH_LOGITS_IN_PLACE = {aten.sub.Tensor: aten.sub_.Tensor, aten.mul.Tensor: aten.mul_.Tensor}


def _storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _keeps_its_shape(args: tuple[Any, ...]) -> bool:
    """Whether `args[0] <op> args[1]` has args[0]'s shape and dtype, so that the in-place op can hold it."""
    first, other = args[0], args[1]
    if not isinstance(other, torch.Tensor):
        return True
    return (
        torch.broadcast_shapes(first.shape, other.shape) == first.shape
        and torch.result_type(first, other) == first.dtype
    )


def _bce_with_logits(func: Any, args: tuple[Any, ...], node: Any, made: set[int]) -> Any:
    in_place = _BCE_WITH_LOGITS_IN_PLACE.get(func)
    if in_place is None or not args or not isinstance(args[0], torch.Tensor):
        return func
    # Only where the Node computes the input's gradient alone: the target's (a formula with other statements,
    # `-self * grad_output` out of place on its own temporary) is left as traced.
    if any(next_node is not None for next_node, _ in node.next_functions[1:]):
        return func
    if _storage_id(args[0]) not in made or not _keeps_its_shape(args):
        return func
    return in_place


PlainPathRule = Callable[[Any, tuple[Any, ...], Any, set[int]], Any]


def _fresh_buffer_rule(ops: dict[Any, Any]) -> PlainPathRule:
    def rule(func: Any, args: tuple[Any, ...], node: Any, made: set[int]) -> Any:
        in_place = ops.get(func)
        # on the buffer the formula made, not a tensor a hook on the Node passes it (which stays the user's)
        if in_place is None or not args or not isinstance(args[0], torch.Tensor) or _storage_id(args[0]) not in made:
            return func
        return in_place

    return rule


# Node class name -> rule(func, args, node, storages the formula made so far) -> the op the plain path runs.
PLAIN_PATH_RULES: dict[str, PlainPathRule] = {
    **{name: _fresh_buffer_rule(ops) for name, ops in _ON_FRESH_BUFFER.items()},
    "BinaryCrossEntropyWithLogitsBackward0": _bce_with_logits,
}


class PlainFormulaPaths:
    """Swaps, inside a backward formula with a subclass branch, the out-of-place op for the plain path's in-place
    one. A dispatch mode calls `op_for` before running an op and `made` with what it returned."""

    def __init__(self) -> None:
        self._node: Any = None
        self._made: set[int] = set()
        self._watching = False

    def op_for(self, func: Any, args: tuple[Any, ...]) -> Any:
        node = torch._C._current_autograd_node()
        rule = PLAIN_PATH_RULES.get(type(node).__name__) if node is not None else None
        # A backward with create_graph=True runs its formulas with grad mode on: BCE's then takes the out-of-place
        # path in a plain run too, and an in-place op on a tensor autograd records would differ from the run.
        self._watching = rule is not None and not torch.is_grad_enabled()
        if not self._watching:
            return func
        if node is not self._node:
            self._node, self._made = node, set()
        return rule(func, args, node, self._made)

    def made(self, out: Any) -> None:
        if self._watching:
            self._made.update(_storage_id(tensor) for tensor in tensors_in(out))
