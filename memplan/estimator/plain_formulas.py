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

`evenly_distribute_backward` (torch/csrc/autograd/FunctionsManual.cpp), the gradient of a full `max()`, `min()`,
`median()` or `nanmedian()`, is another algorithm on each path. The subclass path (and CUDA's) holds three
input-sized boolean masks (`input.isnan()`, its `logical_and`, `input == value`) while `mask.sum()` runs, then
`mask * (grad / mask.sum())`; a plain CPU run makes one mask (`value.isnan().item() ? input.isnan() : input ==
value`) and its result first, `grad.new_zeros(input.sizes(), input.options()).masked_fill_(mask, grad /
mask.sum())`. The sum of a boolean mask casts it to int64 inside the kernel (8 B an element: composite_kernels),
so the plain run peaks there with one mask and the result live, two masks (2 B an element) above the subclass
path: a step whose peak fell there was predicted 11% low. `_EvenlyDistributed` runs the plain path's ops in the
subclass path's places, on the cpu target only.

Left as the subclass path runs them (over-predicting, never under): formulas whose plain path is another
algorithm (`prod_backward` and `cumprod_backward` test for zeros with `.item()`), and the target's gradient of the
binary cross-entropies. A plain run of prod(dim) or cumprod takes the cheap path (`grad * (result / input)`,
cumprod's `cumsum` and division) where the input holds no zero and the subclass path (prod_safe_zeros_backward's
two cumprods of `cat`s and flips; cumprod's masks, cumprods and gathers) where it holds one; a fake tensor has no
values, so the trace keeps the path a run with zeros takes, the heavier: on a [64, 256] activation, cumprod's
gradient was predicted 837,504 B above a zero-free plain run, prod over a dim of 16 368,640 B above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

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
    # atan2_backward (torch 2.13): `recip`, the reciprocal of `self * self + other * other`, masked in place where
    # that sum is 0 (`masked_fill_(denom == 0, 0)`; out of place, `recip.masked_fill(...)`, for a subclass).
    "Atan2Backward0": {aten.masked_fill.Scalar: aten.masked_fill_.Scalar},
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

# clamp_backward and clamp_backward_min_max with both bounds tensors (ClampBackward0, clamp.Tensor):
# the two comparisons' masks, `self >= min` and `self <= max` (for min's gradient `self < min` and `min < max`, for
# max's `self > max` and `max < min`), combined in place into the first, `self_ge_min.logical_and_(self_le_max)`
# (`logical_or_` for max's), out of place for a subclass: one input-sized boolean mask more while
# `where(pred, grad, zero)` runs.
_CLAMP_MASKS_IN_PLACE = {
    aten.logical_and.default: aten.logical_and_.default,
    aten.logical_or.default: aten.logical_or_.default,
}

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


def _bce_with_logits(func: Any, args: tuple[Any, ...], node: Any, made: set[int], kept: dict[str, Any]) -> Any:
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


def _clamp_masks(func: Any, args: tuple[Any, ...], node: Any, made: set[int], kept: dict[str, Any]) -> Any:
    in_place = _CLAMP_MASKS_IN_PLACE.get(func)
    if in_place is None or len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return func
    if _storage_id(args[0]) not in made or not _keeps_its_shape(args):
        return func
    return in_place


# rule(func, args, node, storages the formula made so far, what the rule keeps for this formula) -> the op to run
PlainPathRule = Callable[[Any, tuple[Any, ...], Any, set[int], dict[str, Any]], Any]


def _fresh_buffer_rule(ops: dict[Any, Any]) -> PlainPathRule:
    def rule(func: Any, args: tuple[Any, ...], node: Any, made: set[int], kept: dict[str, Any]) -> Any:
        in_place = ops.get(func)
        # on the buffer the formula made, not a tensor a hook on the Node passes it (which stays the user's)
        if in_place is None or not args or not isinstance(args[0], torch.Tensor) or _storage_id(args[0]) not in made:
            return func
        return in_place

    return rule


def _evenly_distributed(func: Any, args: tuple[Any, ...], node: Any, made: set[int], kept: dict[str, Any]) -> Any:
    """evenly_distribute_backward's subclass path, op by op (`detach` of the gradient aside):

        input_isnan = input.isnan()                        -> the plain path's result, grad.new_zeros(input.sizes())
        value_isnan = value.isnan()                        -> nothing made (the plain path's `value.isnan().item()`
                                                              frees its 1 B at once): an alias of the value
        and = input_isnan.logical_and(value_isnan)         -> nothing made: an alias of that
        mask = input == value                              (the plain path's mask; input.isnan() where value is NaN)
        mask.logical_or_(and)                              -> nothing done
        count = mask.sum(); share = grad / count           (both paths)
        mask * share                                       -> result.masked_fill_(mask, share)

    The result is held here from the first op to the last, which lets go of it before returning it (AccumulateGrad
    adopts a gradient no one else references: a reference kept here would make it copy)."""
    if func is aten.isnan.default and "result" not in kept:

        def result_buffer(input: torch.Tensor) -> torch.Tensor:
            kept["result"] = input.new_zeros(input.shape)
            return kept["result"]

        return result_buffer
    if kept.get("result") is None:
        return func
    if func is aten.isnan.default:  # the plain path's is a temporary, gone once `.item()` has read it
        return aten.alias.default
    if func is aten.logical_and.default and _storage_id(args[0]) == _storage_id(kept["result"]):
        return lambda input_isnan, value_isnan: aten.alias.default(value_isnan)
    if func is aten.eq.Tensor:

        def mask(input: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            # Which mask the plain path makes follows the value, which a fake tensor does not have (both are
            # the input's size in booleans); a real run's (the CPU counter's) is the plain run's, value for value.
            if not isinstance(value, FakeTensor) and bool(value.isnan()):
                return aten.isnan.default(input)
            return aten.eq.Tensor(input, value)

        return mask
    if func is aten.logical_or_.default:
        return lambda mask, both_nan: mask
    if func is aten.mul.Tensor:

        def fill(mask: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
            result = kept.pop("result")
            return aten.masked_fill_.Tensor(result, mask, share)

        return fill
    return func


# evenly_distribute_backward's Nodes (tools/autograd/derivatives.yaml: max(), min(), median(), nanmedian()).
_EVENLY_DISTRIBUTED = ("MaxBackward1", "MinBackward1", "MedianBackward0", "NanmedianBackward0")

# Node class name -> rule(func, args, node, storages the formula made so far, what the rule keeps) -> the op the
# plain path runs.
PLAIN_PATH_RULES: dict[str, PlainPathRule] = {
    **{name: _fresh_buffer_rule(ops) for name, ops in _ON_FRESH_BUFFER.items()},
    "BinaryCrossEntropyWithLogitsBackward0": _bce_with_logits,
    "ClampBackward0": _clamp_masks,  # clamp.Tensor (ClampBackward1 is clamp.Scalar's, without such a branch)
}
# The plain path on the CPU only: CUDA takes the subclass path (`|| input.is_cuda()`).
CPU_PLAIN_PATH_RULES: dict[str, PlainPathRule] = {name: _evenly_distributed for name in _EVENLY_DISTRIBUTED}


class PlainFormulaPaths:
    """Swaps, inside a backward formula with a subclass branch, the out-of-place op for the plain path's in-place
    one. A dispatch mode calls `op_for` before running an op and `made` with what it returned."""

    def __init__(self, target: str = "cpu") -> None:
        """`target`: the device the step runs on (a cuda target's fake tensors are CPU ones, their formulas CUDA's)."""
        self._rules = {**PLAIN_PATH_RULES, **(CPU_PLAIN_PATH_RULES if target == "cpu" else {})}
        self._node: Any = None
        self._made: set[int] = set()
        self._kept: dict[str, Any] = {}
        self._watching = False

    def op_for(self, func: Any, args: tuple[Any, ...]) -> Any:
        node = torch._C._current_autograd_node()
        rule = self._rules.get(type(node).__name__) if node is not None else None
        # A backward with create_graph=True runs its formulas with grad mode on: BCE's then takes the out-of-place
        # path in a plain run too, and an in-place op on a tensor autograd records would differ from the run.
        self._watching = rule is not None and not torch.is_grad_enabled()
        if not self._watching:
            return func
        if node is not self._node:
            self._node, self._made, self._kept = node, set(), {}
        return rule(func, args, node, self._made, self._kept)

    def made(self, out: Any) -> None:
        if self._watching:
            self._made.update(_storage_id(tensor) for tensor in tensors_in(out))
