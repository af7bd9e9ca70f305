"""What the CPU EmbeddingBag kernels allocate inside themselves (aten/src/ATen/native/EmbeddingBag.cpp, torch
2.11-2.14), which no dispatch mode sees (memplan.estimator.composite_kernels): `offset2bag` built with a second copy
of itself (a cumsum), the bag sizes' differences, a resized `max_indices`, a mean's divisors; the backward's sort of the
indices and what it gathers by the sorted order, a max backward's gathered rows. Each rule follows the kernel's
allocations in order and returns the most held at once beyond the op's outputs. CUDA's kernels (EmbeddingBag.cu) are
other code: 0 there.

Measured op by op with torch.profiler (tests/test_embedding_bag_kernels.py): a [300, 32] float32 table, 8 bags of 20
int64 indices: the backward of a sum held 5,128 B beside its 38,400 B gradient, a mean's forward 1,160 B beside its
outputs, a max backward 3,136 B.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.composite_kernels import _nbytes, bound_arguments, composite_kernel_scratch
from memplan.estimator.oprules import output_bytes_rule

MODE_SUM, MODE_MEAN, MODE_MAX = 0, 1, 2
_WRAPPED_SCALAR = torch.int64.itemsize  # `offset2bag[0] -= 1`: the 1 wrapped in a 0-d int64 tensor
_FAST_PATH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _index_dtype(indices: torch.Tensor, offsets: torch.Tensor) -> torch.dtype:
    """`promoteIndicesAndOffsets`: both in their promoted type."""
    return torch.promote_types(indices.dtype, offsets.dtype)


def _promotion_copy(indices: torch.Tensor, offsets: torch.Tensor) -> int:
    """`promoteIndicesAndOffsets` copies whichever of indices and offsets is not of the promoted type (held while the
    kernel runs)."""
    dtype = _index_dtype(indices, offsets)
    return sum(tensor.numel() * dtype.itemsize for tensor in (indices, offsets) if tensor.dtype != dtype)


def _fast_path(weight_dtype: torch.dtype, per_sample_weights: Any, padding_idx: int, weight_stride1: int = 1) -> bool:
    """`is_fast_path`: the CPU's sum skips offset2bag for float32/float16/bfloat16 tables read along rows, unpadded,
    with unit-stride per-sample weights (the fake kernel leaves bfloat16 out)."""
    scale_ok = not isinstance(per_sample_weights, torch.Tensor) or per_sample_weights.stride(0) == 1
    return weight_dtype in _FAST_PATH_DTYPES and weight_stride1 == 1 and padding_idx < 0 and scale_ok


def _make_offset2bag_held(num_indices: int, offsets: torch.Tensor, itemsize: int) -> tuple[int, int]:
    """(held at its fullest, held after) while `make_offset2bag` fills a zeroed [N + 1] offset2bag: `index_add_` of
    `ones_like(offsets)`, `offset2bag[0] -= 1` (a wrapped scalar), then `offset2bag = offset2bag.cumsum(0)`, the old
    storage freed as the new one replaces it. The [N + 1] storage stays when it is resized to N."""
    storage = (num_indices + 1) * itemsize
    return storage + max(offsets.numel() * itemsize, _WRAPPED_SCALAR, storage), storage


def _offset2bag_made(mode: int, weight: torch.Tensor, per_sample_weights: Any, padding_idx: int) -> bool:
    """`make_offset2bag_out`: built for mean and max, and for a sum off the fast path."""
    return mode != MODE_SUM or not _fast_path(weight.dtype, per_sample_weights, padding_idx, weight.stride(1))


def _forward_outputs(bound: dict[str, Any], requires_grad: bool) -> list[int]:
    """The storage bytes of `_embedding_bag_cpu_impl`'s four outputs: output; offset2bag at [N + 1] (resized down to
    N, keeping its storage) or none; bag_size made at offsets' size (resized down to the bag count for mean, max or
    where grad is required, keeping its storage); max_indices at bag_size's size, grown to [bags, D] for max."""
    weight, indices, offsets, mode = bound["weight"], bound["indices"], bound["offsets"], bound["mode"]
    itemsize = _index_dtype(indices, offsets).itemsize
    bags = offsets.size(0) - (1 if bound["include_last_offset"] else 0)
    output = bags * weight.size(1) * weight.element_size()
    made = _offset2bag_made(mode, weight, bound["per_sample_weights"], bound["padding_idx"])
    offset2bag = (indices.size(0) + 1) * itemsize if made else 0
    bag_size = offsets.numel() * itemsize
    first_max_indices = (bags if requires_grad or mode != MODE_SUM else offsets.numel()) * itemsize
    grown = bags * weight.size(1) * itemsize if mode == MODE_MAX else 0
    return [output, offset2bag, bag_size, max(first_max_indices, grown)]


def _forward_output_bytes(args: tuple[Any, ...], kwargs: dict[str, Any], device: str, requires_grad: bool) -> list[int]:
    """On the CPU, offset2bag keeps its [N + 1] storage (make_offset2bag_out resizes it down), a bfloat16 sum on the
    fast path makes none (the fake kernel's is [N]: its is_fast_path leaves bfloat16 out), and bag_size keeps
    offsets' size with include_last_offset. CUDA's are made at their sizes, as the meta function's non-CPU branch has
    them (torch/_meta_registrations.py, meta_embedding_bag, after EmbeddingBag.cu): offset2bag [N] in every mode,
    bag_size at offsets' size, max_indices [bags, D] for max and empty otherwise."""
    bound = bound_arguments(torch.ops.aten._embedding_bag.default, args, kwargs)
    if device != "cpu":
        weight, indices, offsets = bound["weight"], bound["indices"], bound["offsets"]
        bags = offsets.size(0) - (1 if bound["include_last_offset"] else 0)
        item, dim = indices.element_size(), weight.size(1)
        max_indices = bags * dim * item if bound["mode"] == MODE_MAX else 0
        return [bags * dim * weight.element_size(), indices.numel() * item, offsets.numel() * item, max_indices]
    return _forward_outputs(bound, requires_grad)


@output_bytes_rule(torch.ops.aten._embedding_bag.default)
def embedding_bag_output_bytes(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    return _forward_output_bytes(args, kwargs, device, requires_grad=True)


@output_bytes_rule(torch.ops.aten._embedding_bag_forward_only.default)
def embedding_bag_forward_only_output_bytes(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    return _forward_output_bytes(args, kwargs, device, requires_grad=False)


def _forward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str, requires_grad: bool) -> int:
    """`_embedding_bag_cpu_impl` (`_embedding_bag` with requires_grad, `_embedding_bag_forward_only` without), in
    order: the output; offset2bag (make_offset2bag, its cumsum beside it) for mean, max or a sum off the fast path;
    bag_size at offsets' size, then `offsets[1:] - offsets[:-1]` and `indices.size(0) - offsets[-1]` (a 0-d tensor)
    for mean, max or where grad is required; max_indices at bag_size's size, which max grows to [bags, D] (a new
    storage beside the old until resize_ frees it). A mean divides by `at::max(bag_size, ones_like(bag_size)).to(
    output dtype)`, all three held at once. A float16/bfloat16 sum or mean off the fast path accumulates in float32:
    a [bags, D] output and (unweighted, index_select_add) a [D] row; a weighted one on the fast path converts the
    weights to float32 (index_select_scale_add's scale_fp32)."""
    if device != "cpu":
        return 0
    bound = bound_arguments(torch.ops.aten._embedding_bag.default, args, kwargs)
    weight, indices, offsets, mode = bound["weight"], bound["indices"], bound["offsets"], bound["mode"]
    if not isinstance(indices, torch.Tensor) or not isinstance(offsets, torch.Tensor) or weight.dim() != 2:
        return 0
    itemsize = _index_dtype(indices, offsets).itemsize
    output, offset2bag, bag_size, max_indices = _forward_outputs(bound, requires_grad)
    bags, dim = offsets.size(0) - (1 if bound["include_last_offset"] else 0), weight.size(1)
    held, now = [], _promotion_copy(indices, offsets) + output
    if offset2bag:
        fullest, _ = _make_offset2bag_held(indices.size(0), offsets, itemsize)
        held.append(now + fullest)
    now += offset2bag + bag_size
    if mode != MODE_SUM or requires_grad:
        differences = (bags - 1) * itemsize if bags > 1 else 0
        held.append(now + max(differences, itemsize if bags > 0 else 0))
    first_max_indices = (bags if requires_grad or mode != MODE_SUM else offsets.numel()) * itemsize
    if max_indices > first_max_indices:
        held.append(now + first_max_indices + max_indices)
    now += max_indices
    if mode == MODE_MEAN:
        held.append(now + 2 * bags * itemsize + bags * weight.element_size())
    per_sample_weights = bound["per_sample_weights"]
    if mode != MODE_MAX and weight.dtype in (torch.float16, torch.bfloat16):
        weighted = isinstance(per_sample_weights, torch.Tensor)
        if _fast_path(weight.dtype, per_sample_weights, bound["padding_idx"], weight.stride(1)):
            fp32 = per_sample_weights.numel() if weighted else 0  # scale_fp32 (FBGEMM converts the weights into it)
        else:
            fp32 = bags * dim + (0 if weighted else dim)  # output_fp32, and index_select_add's src_fp32 row
        held.append(now + fp32 * torch.float32.itemsize)
    return max(0, max(held, default=0) - (output + offset2bag + bag_size + max_indices))


@composite_kernel_scratch(torch.ops.aten._embedding_bag.default)
def embedding_bag_forward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    return _forward_scratch(args, kwargs, device, requires_grad=True)


@composite_kernel_scratch(torch.ops.aten._embedding_bag_forward_only.default)
def embedding_bag_forward_only_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    return _forward_scratch(args, kwargs, device, requires_grad=False)


embedding_bag_forward_scratch.__doc__ = embedding_bag_forward_only_scratch.__doc__ = _forward_scratch.__doc__


def _dense_backward_scratch(
    grad: torch.Tensor,
    indices: torch.Tensor,
    offset2bag_dtype: torch.dtype,
    bag_size: torch.Tensor,
    max_indices: torch.Tensor,
    mode: int,
    per_sample_weights: Any,
) -> int:
    """`_embedding_bag_dense_backward_cpu`: `grad_.contiguous()` held throughout; then, beside the zeroed gradient
    (the output):
    - sum and mean (_embedding_bag_dense_backward_cpu_sum_mean): `indices.sort()`, its values and int64 positions
      beside sort's own `arange` (_fill_indices, freed as sort returns); then the sorted values and positions with
      `offset2bag.index_select(0, ind_sort)` and, weighted, `per_sample_weights.index_select(0, ind_sort)`;
    - max (_embedding_bag_dense_backward_cpu_max): `max_indices.index_select(0, bag_size.nonzero().view(-1))`,
      `grad.index_select(0, ...)` with the second nonzero's [bags, 1] int64, then one column of the gathered indices
      made contiguous per feature for `index_add_`. Every bag is taken as nonempty (an empty bag's row is not
      gathered: the rule is then a few rows high)."""
    copy = 0 if grad.is_contiguous() else _nbytes(grad)
    count = indices.numel()
    if mode == MODE_MAX:
        bags, dim = bag_size.numel(), grad.size(1)
        gathered = bags * dim * (max_indices.element_size() + grad.element_size())
        column = bags * max_indices.element_size() if bags > 1 and dim > 1 else 0
        return copy + gathered + max(bags * torch.int64.itemsize, column)
    sorted_pair = count * (indices.element_size() + torch.int64.itemsize)
    gathered = count * offset2bag_dtype.itemsize
    if isinstance(per_sample_weights, torch.Tensor):
        gathered += count * per_sample_weights.element_size()
    return copy + sorted_pair + max(count * torch.int64.itemsize, gathered)


@composite_kernel_scratch(torch.ops.aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    if device != "cpu":
        return 0
    bound = bound_arguments(torch.ops.aten._embedding_bag_dense_backward.default, args, kwargs)
    return _dense_backward_scratch(
        bound["grad"],
        bound["indices"],
        bound["offset2bag"].dtype,
        bound["bag_size"],
        bound["maximum_indices"],
        bound["mode"],
        bound["per_sample_weights"],
    )


embedding_bag_dense_backward_scratch.__doc__ = _dense_backward_scratch.__doc__


def _fake_offset2bag(bound: dict[str, Any]) -> bool:
    """Whether the forward's offset2bag is one the fake kernel made where the CPU's made none: a bfloat16 sum on the
    fast path (the meta function's is_fast_path leaves bfloat16 out; the table's row stride, which the backward does
    not see, taken as 1)."""
    grad, mode = bound["grad"], bound["mode"]
    return (
        mode == MODE_SUM
        and grad.dtype == torch.bfloat16
        and _fast_path(grad.dtype, bound["per_sample_weights"], bound["padding_idx"])
    )


@composite_kernel_scratch(torch.ops.aten._embedding_bag_backward.default)
def embedding_bag_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`_embedding_bag_backward_symint` (CompositeImplicitAutograd, run as one op): the forward of a sum on the fast
    path made no offset2bag, so it makes one, `offsets.new_zeros({N + 1})` filled by make_offset2bag (its cumsum
    beside it) and held through the dense backward (above), which is its output's op. The sparse backward is not
    modelled (0)."""
    if device != "cpu":
        return 0
    bound = bound_arguments(torch.ops.aten._embedding_bag_backward.default, args, kwargs)
    grad, indices, offsets, offset2bag = bound["grad"], bound["indices"], bound["offsets"], bound["offset2bag"]
    if bound["sparse"] or grad.dim() != 2:
        return 0
    itemsize = _index_dtype(indices, offsets).itemsize
    output = bound["num_weights"] * grad.size(1) * grad.element_size()
    held, kept = [], _promotion_copy(indices, offsets)
    offset2bag_dtype = offset2bag.dtype
    if indices.numel() != 0 and (offset2bag.numel() == 0 or _fake_offset2bag(bound)):
        fullest, storage = _make_offset2bag_held(indices.size(0), offsets, itemsize)
        held.append(kept + fullest - output)
        kept += storage
        offset2bag_dtype = _index_dtype(indices, offsets)
    dense = _dense_backward_scratch(
        grad,
        indices,
        offset2bag_dtype,
        bound["bag_size"],
        bound["maximum_indices"],
        bound["mode"],
        bound["per_sample_weights"],
    )
    held.append(kept + dense)
    return max(0, *held)


@composite_kernel_scratch(torch.ops.aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward_scratch(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> int:
    """`_embedding_bag_per_sample_weights_backward_cpu_template`: the [N] output zeroed first; where the forward made
    no offset2bag (a sum on the fast path, the only mode with weights), `at::zeros({N + 1})` filled by make_offset2bag
    (its cumsum beside it), held to the end; the dot products allocate nothing."""
    if device != "cpu":
        return 0
    bound = bound_arguments(torch.ops.aten._embedding_bag_per_sample_weights_backward.default, args, kwargs)
    indices, offsets, offset2bag = bound["indices"], bound["offsets"], bound["offset2bag"]
    promotion = _promotion_copy(indices, offsets)
    fake_offset2bag = _fake_offset2bag(bound | {"per_sample_weights": None})  # the weights' stride taken as 1
    if indices.numel() == 0 or (offset2bag.numel() != 0 and not fake_offset2bag):
        return promotion
    fullest, _ = _make_offset2bag_held(indices.size(0), offsets, offset2bag.element_size())
    return promotion + fullest
