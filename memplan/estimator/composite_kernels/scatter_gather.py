"""The CPU gather and scatter kernels' float32 copies of a float16/bfloat16 tensor they write: DeBERTa-v2's (and
SEW-D's) disentangled attention gathers its content-to-position and position-to-content scores
(`torch.gather(c2p_att, -1, ...)`), and their gradients are scatter-added (`gather_backward`); in bfloat16 each holds a
float32 copy of the scores (of the gradient buffer) beside its output, which no dispatch mode sees
(memplan.estimator.composite_kernels).

aten/src/ATen/native/cpu/ScatterGatherKernel.cpp (torch 2.11-2.14), `cpu_scatter_gather_base_kernel`, which runs
gather (`gather_cpu_kernel`, writing the result), scatter with a tensor or a value (`scatter_cpu_kernel`,
`scatter_fill_cpu_kernel`), scatter_add (`scatter_add_cpu_kernel`) and every scatter_reduce
(`scatter_reduce_cpu_kernel`, `scatter_scalar_reduce_cpu_kernel`, `scatter_reduce_two_cpu_kernel`), each writing `self`:

    Tensor buffer;
    bool need_acc = isReducedFloatingType(self.scalar_type());
    create_acc_buffer(buffer, self, need_acc);  // at::empty(self.sizes(), opmath dtype); buffer.copy_(self)
    ... the loop, over `buffer` ...
    if (need_acc) { self.copy_(buffer); }

The GNN fast paths skip it (aten/src/ATen/native/TensorAdvancedIndexing.cpp, `can_use_expanded_index_path`: FBGEMM's
radix sort with OpenMP, a floating tensor written along dim 0, index of stride 1 there and 0 (or 1 over a size of 1)
elsewhere, the same sizes as src past dim 0, src and the written tensor contiguous, and, for a scatter, at least 16
elements per index row): gather then copies rows and allocates nothing (`cpu_gather_expanded_index_kernel`); scatter_add
and scatter_reduce.two (`cpu_scatter_reduce_expanded_index`) accumulate a float16/bfloat16 tensor in
`at::zeros({num_threads, K}, float32)` instead.

`scatter_reduce.two` with "mean" then counts (TensorAdvancedIndexing.cpp, `scatter_reduce_two`, not on the fast path):

    auto ones = at::ones_like(src);
    auto count = include_self ? at::ones_like(out) : at::zeros_like(out);
    count.scatter_add_(dim, index, ones);
    count.masked_fill_(count == 0, 1);

and without `include_self` first fills the written elements (`scatter_reduce_exclude_self_helper`: `self.scatter_(dim,
index, init_val)`, a buffer of its own, freed before the reduction's).

Measured with torch.profiler's memory events on the CPU (torch 2.13; tests/test_scatter_gather_scratch.py): a bfloat16
gather of [8, 32, 32] from [8, 32, 64] allocates its 16,384 B output and a 32,768 B float32 buffer; a scatter_add_ into
[8, 32, 64] bfloat16 zeros 65,536 B; float32 and float64 nothing; the expanded dim-0 scatter_add_ with 32 columns 256 B
on 2 threads. CUDA's kernels (ScatterGatherKernel.cu) accumulate in registers: nothing there.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from memplan.estimator.composite_kernels import _LOW_PRECISION, INTRA_OP_THREADS, composite_kernel_scratch

aten = torch.ops.aten

_FLOAT32 = torch.float32.itemsize
# `scatter_add_expanded_index` and `scatter_reduce_expanded_index` need at least this many elements per index row
# (TensorAdvancedIndexing.cpp, can_use_expanded_index_path: "only perf beneficial when the inner dimension ... is big
# enough"); gather's fast path has no such limit.
_SCATTER_ROW_THRESHOLD = 16


def _radix_sort_with_openmp() -> bool:
    """`fbgemm::is_radix_sort_accelerated_with_openmp()` in this torch: built with FBGEMM (whose engine it then offers)
    and OpenMP."""
    return "fbgemm" in torch.backends.quantized.supported_engines and torch.backends.openmp.is_available()


def _expanded_index_path(
    written: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, scatter: bool
) -> bool:
    """TensorAdvancedIndexing.cpp's `can_use_expanded_index_path(self, dim, index, src, is_scatter_like)` (torch
    2.11-2.14), `written` being the tensor the kernel writes (gather's result, a scatter's self)."""
    if not _radix_sort_with_openmp() or not written.dtype.is_floating_point:
        return False
    if 0 in (written.numel(), index.numel(), src.numel()) or 0 in (written.dim(), index.dim(), src.dim()):
        return False
    if any(src.shape[d] != index.shape[d] for d in range(1, index.dim())):
        return False
    if scatter and index.numel() // index.shape[0] < _SCATTER_ROW_THRESHOLD:
        return False
    strides, sizes = index.stride(), index.shape
    expanded = strides[0] == 1 and all(
        strides[d] <= 1 and not (strides[d] == 1 and sizes[d] > 1) for d in range(1, index.dim())
    )
    return dim % written.dim() == 0 and expanded and src.is_contiguous() and written.is_contiguous()


def _accumulation_buffer(written: torch.Tensor) -> int:
    """`create_acc_buffer`: a float32 tensor of the written tensor's sizes where that is float16 or bfloat16."""
    return written.numel() * _FLOAT32 if written.dtype in _LOW_PRECISION else 0


def _fast_path_buffer(written: torch.Tensor, index: torch.Tensor) -> int:
    """`cpu_scatter_reduce_expanded_index`'s `at::zeros({num_threads, K}, float32)` for a float16/bfloat16 tensor, K
    being the elements per index row."""
    if written.dtype not in _LOW_PRECISION:
        return 0
    return INTRA_OP_THREADS * (index.numel() // index.shape[0]) * _FLOAT32


@composite_kernel_scratch(aten.gather.default)
def gather_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """gather(self, dim, index): the result has index's sizes and self's dtype, made contiguous before the kernel runs
    (its structured meta function); the float32 buffer is the result's size."""
    self, dim, index = args[0], args[1], args[2]
    if device != "cpu" or index.numel() == 0:
        return 0
    result = torch.empty(index.shape, dtype=self.dtype, device="meta")
    if _expanded_index_path(result, dim, index, self, scatter=False):
        return 0
    return _accumulation_buffer(result)


@composite_kernel_scratch(
    aten.scatter.src,
    aten.scatter_.src,
    aten.scatter.value,
    aten.scatter_.value,
    aten.scatter.reduce,
    aten.scatter_.reduce,
    aten.scatter.value_reduce,
    aten.scatter_.value_reduce,
)
def scatter_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """scatter(self, dim, index, src or value[, reduce]) (`scatter_impl`; no fast path): the float32 buffer of self's
    (the output's) size."""
    self, index = args[0], args[2]
    if device != "cpu" or index.numel() == 0:
        return 0
    return _accumulation_buffer(self)


@composite_kernel_scratch(aten.scatter_add.default, aten.scatter_add_.default)
def scatter_add_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """scatter_add(self, dim, index, src): the float32 buffer of self's size, or the fast path's per-thread rows."""
    self, dim, index, src = args[0], args[1], args[2], args[3]
    if device != "cpu" or index.numel() == 0:
        return 0
    if _expanded_index_path(self, dim, index, src, scatter=True):
        return _fast_path_buffer(self, index)
    return _accumulation_buffer(self)


@composite_kernel_scratch(aten.scatter_reduce.two, aten.scatter_reduce_.two)
def scatter_reduce_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """scatter_reduce(self, dim, index, src, reduce, *, include_self=True): the fast path's rows; else the float32
    buffer (the exclude-self fill's first, freed, then the reduction's: one at a time), and for "mean" the counting
    after it: `ones` (src's size) and `count` (self's) held together with the larger of count's scatter_add_ buffer
    and `count == 0`'s wrapped 0 (int64, 8 B), its cast to count's dtype and the bool mask."""
    self, dim, index, src, reduce = args[0], args[1], args[2], args[3], args[4]
    if device != "cpu":
        return 0
    if _expanded_index_path(self, dim, index, src, scatter=True):
        return _fast_path_buffer(self, index)
    buffer = _accumulation_buffer(self) if index.numel() else 0
    if reduce != "mean":
        return buffer
    ones = src.numel() * src.element_size()
    count = self.numel() * self.element_size()
    counted = buffer  # count.scatter_add_ takes the path the reduction took: count has self's sizes and layout
    cast = 0 if self.dtype == torch.int64 else self.element_size()
    compared = torch.int64.itemsize + cast + math.prod(self.shape) * torch.bool.itemsize
    return max(buffer, ones + count + max(counted, compared))
