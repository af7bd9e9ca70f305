"""What the CPU's reductions, scans and softmax kernels hold inside themselves beside their output (torch 2.11-2.14):
a float32 accumulation buffer for a 16-bit sum over reduced dimensions TensorIterator cannot merge, casts of the
input to the dtype asked for, contiguous copies of a strided input, and logsumexp's own ops. Measured against the
CPU allocator's own events with no dispatch mode active (tests/test_reduction_scratch.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from memplan.estimator.composite_kernels import (
    _LOW_PRECISION,
    _nbytes,
    _reduction_dtypes,
    composite_kernel_scratch,
    contiguous_copy_bytes,
    kernel_scratch_bytes,
    mean_input_cast,
)
from memplan.estimator.memory_formats import meta_like

_SUM = torch.ops.aten.sum.dim_IntList


def _reduced_dims(self: torch.Tensor, dims: Any) -> set[int]:
    """The dimensions a reduction over `dims` reduces (all of them where none are given)."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return set(range(self.dim()))
    dims = [dims] if isinstance(dims, int) else dims
    return {d % max(self.dim(), 1) for d in dims}


def _iterator_output_strides(self: torch.Tensor, reduced: set[int]) -> list[int]:
    """The output's strides in a reduction's TensorIterator, in `self`'s order of dimensions, after its reordering
    and merging of dimensions (aten/src/ATen/TensorIterator.cpp, torch 2.11-2.14): the result is allocated
    contiguous (ReduceOpsUtils.h resize_reduction), viewed with stride 0 in each reduced dimension
    (review_reduce_result); `reorder_dimensions` sorts the dimensions, fastest first, putting those the output
    reduces (stride 0) before the others and breaking ties by the input's strides; `coalesce_dimensions` merges
    neighbours where `shape[d0] * stride[d0] == stride[d1]` for every operand, or either has size 1."""
    shape = list(self.shape)
    kept = [size for d, size in enumerate(shape) if d not in reduced]
    out_contig = [math.prod(kept[i + 1 :]) for i in range(len(kept))]
    out = [0 if d in reduced else out_contig.pop(0) for d in range(len(shape))]
    operands = [out, list(self.stride())]

    def should_swap(d0: int, d1: int) -> int:
        for index, strides in enumerate(operands):
            s0, s1 = strides[d0], strides[d1]
            if index == 0 and (s0 == 0) != (s1 == 0):  # the output's reduced dimensions go first
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(len(shape))))
    for i in range(1, len(perm)):  # the iterator's insertion sort, which stops at an ambiguous comparison
        d1 = i
        for d0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[d0], perm[d1])
            if comparison > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif comparison < 0:
                break
    sizes = [shape[d] for d in perm]
    strides = [[s[d] for d in perm] for s in operands]
    if len(sizes) <= 1:
        return strides[0]
    prev = 0
    for dim in range(1, len(sizes)):
        mergeable = sizes[prev] == 1 or sizes[dim] == 1 or all(s[prev] * sizes[prev] == s[dim] for s in strides)
        if mergeable:
            if sizes[prev] == 1:
                for s in strides:
                    s[prev] = s[dim]
            sizes[prev] *= sizes[dim]
        else:
            prev += 1
            if prev != dim:
                for s in strides:
                    s[prev] = s[dim]
                sizes[prev] = sizes[dim]
    return strides[0][: prev + 1]


def sum_float_buffer_bytes(self: torch.Tensor, dims: Any, in_dtype: torch.dtype, device: str) -> int:
    """CPU `sum_out` (aten/src/ATen/native/ReduceOps.cpp, torch 2.11-2.14) of a float16/bfloat16 iterator whose two
    fastest dimensions are both reduced (`should_use_acc_buffer`: TensorIterator's loop would otherwise accumulate
    the second in 16 bits, pytorch/pytorch#83149) runs

        auto tmp_output = at::empty(result.sizes(), result.options().dtype(kFloat));
        at::sum_outf(self.to(ScalarType::Float), opt_dim, keepdim, std::nullopt, tmp_output);

    a float32 result and a float32 copy of the input, held together beside the output. A sum over reduced
    dimensions that merge into one (the leading ones of a contiguous tensor, or all of them) reduces in place."""
    if device != "cpu" or in_dtype not in _LOW_PRECISION or self.numel() == 0:
        return 0
    reduced = _reduced_dims(self, dims)
    strides = _iterator_output_strides(self, reduced)
    if len(strides) < 2 or strides[0] != 0 or strides[1] != 0:
        return 0
    kept = math.prod(size for d, size in enumerate(self.shape) if d not in reduced)
    # `self.to(ScalarType::Float)` reads the op's own argument: a float32 one summed into a 16-bit `dtype=` (the
    # iterator's input is its 16-bit cast) comes back as itself, no copy
    input_copy = 0 if self.dtype == torch.float32 else self.numel() * torch.float32.itemsize
    return kept * torch.float32.itemsize + input_copy


@composite_kernel_scratch(torch.ops.aten.logsumexp.default)
def logsumexp_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`logsumexp` (ReduceOps.cpp logsumexp_out_impl, CompositeExplicitAutograd, torch 2.11-2.14):

        auto maxes = at::amax(at::real(self), dims, true);
        maxes_squeezed.masked_fill_(maxes_squeezed.abs() == INFINITY, 0);
        at::sum_out(result, (self - maxes).exp_(), dims, keepdim);

    `maxes` (the reduced shape, kept) and `self - maxes` (self's size) held while the sum runs, with what that sum
    holds itself (sum_float_buffer_bytes); an integral input is first cast to the default dtype and summed so."""
    self = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim", [])
    if self.numel() == 0:
        return 0
    cast = 0
    if not self.dtype.is_floating_point and not self.is_complex():
        cast = self.numel() * torch.get_default_dtype().itemsize
        self = meta_like(self).to(torch.get_default_dtype())
    reduced = _reduced_dims(self, dims)
    maxes = math.prod(1 if d in reduced else size for d, size in enumerate(self.shape)) * self.element_size()
    difference = torch.empty_like(meta_like(self))  # TensorIterator keeps a dense input's layout, as empty_like
    inner = kernel_scratch_bytes(_SUM, (difference, sorted(reduced)), {}, device)
    return cast + maxes + _nbytes(self) + inner


@composite_kernel_scratch(torch.ops.aten.cumsum.default, torch.ops.aten.cumprod.default)
def output_dtype_cast(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`cumsum`/`cumprod` (ReduceOps.cpp impl_func_cum_ops, both devices, torch 2.11-2.14) scan
    `self.to(result.scalar_type())`: a whole copy where `dtype` differs from the input's, or for an integral or
    bool input (whose scan is int64)."""
    self, dtype = args[0], kwargs.get("dtype")
    if self.dim() == 0 or self.numel() == 0:
        return 0
    out_dtype = dtype or (torch.int64 if not self.dtype.is_floating_point and not self.is_complex() else self.dtype)
    return 0 if out_dtype == self.dtype else self.numel() * out_dtype.itemsize


@composite_kernel_scratch(torch.ops.aten.prod.default, torch.ops.aten.prod.dim_int)
def reduction_input_cast(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`prod` (ReduceOps.cpp, make_reduction_from_out_ty) reduces `self.to(out_dtype)` as sum does."""
    self = args[0]
    _, in_dtype = _reduction_dtypes(self, kwargs.get("dtype"), device)
    return 0 if in_dtype == self.dtype else self.numel() * in_dtype.itemsize


@composite_kernel_scratch(
    torch.ops.aten.linalg_vector_norm.default,
    torch.ops.aten.norm.ScalarOpt_dim_dtype,
    torch.ops.aten.norm.ScalarOpt_dtype,
)
def vector_norm_input_cast(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`linalg_vector_norm_out` (aten/src/ATen/native/LinearAlgebra.cpp, torch 2.11-2.14; `norm` calls it) with
    `dtype`: `make_reduction` reduces `self.to(dtype)` (a CUDA 16-bit input into float32 is read as it is), a
    reduction over size-1 dimensions takes `abs` of `self.to(dtype)` on either device. The cuda target models its
    own norm reductions (memplan.estimator.transients), so this is the CPU's."""
    self, dtype = args[0], kwargs.get("dtype")
    if device != "cpu" or dtype is None or dtype == self.dtype or self.is_complex():
        return 0
    return self.numel() * dtype.itemsize


@composite_kernel_scratch(
    torch.ops.aten._softmax.default,
    torch.ops.aten._log_softmax.default,
    torch.ops.aten.max.default,
    torch.ops.aten.min.default,
)
def contiguous_input_copy(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The CPU `softmax_cpu_out`/`log_softmax_cpu_out` (aten/src/ATen/native/SoftMax.cpp) and `max()`/`min()` of a
    whole tensor (ReduceAllOps.cpp: `max_all_stub(self.device().type(), ..., self.contiguous())`, code both devices
    share) read `input.contiguous()`: a copy of a strided input, held beside the output. CUDA's
    `softmax_cuda_out`/`log_softmax_cuda_out` (cuda/SoftMax.cu, torch 2.11-2.14) call `host_softmax`, whose first
    line is `auto input = input_.contiguous();`, held until it returns: the same copy (a softmax over a dimension
    other than the last, of a transposed or windowed tensor)."""
    self = args[0]
    if self.numel() == 0:
        return 0
    return contiguous_copy_bytes(self, torch.contiguous_format)


@composite_kernel_scratch(
    torch.ops.aten._softmax_backward_data.default, torch.ops.aten._log_softmax_backward_data.default
)
def softmax_backward_copies(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """CPU `softmax_backward_cpu_out`/`log_softmax_backward_cpu_out` (SoftMax.cpp) read `grad.contiguous()` and
    `output.contiguous()`, both held beside grad_input (CUDA's: memplan.estimator.cuda.softmax_backward)."""
    grad, output = args[0], args[1]
    if device != "cpu":
        return 0
    return sum(contiguous_copy_bytes(t, torch.contiguous_format) for t in (grad, output) if t.dim() > 0)


@composite_kernel_scratch(torch.ops.aten.var.correction, torch.ops.aten.std.correction)
def var_of_all_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """CPU `std_var_out` (ReduceOps.cpp, torch 2.11-2.14) reducing every dimension that is not of size 1 (the
    iterator's `num_reduce_dims() == ndim()`) of a float32/float64 tensor calls `std_var_all_cpu`, which begins
    `self.mean().item<double>()`: a whole mean, its output and what it holds inside itself (mean_input_cast), freed
    before the two-pass variance. A 16-bit input, or one keeping a dimension, runs std_var_stub (nothing)."""
    self = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if device != "cpu" or self.dtype not in (torch.float32, torch.float64) or self.numel() == 0:
        return 0
    reduced = _reduced_dims(self, dims)
    if any(size != 1 for d, size in enumerate(self.shape) if d not in reduced):
        return 0
    return self.element_size() + mean_input_cast((self,), {}, device)
