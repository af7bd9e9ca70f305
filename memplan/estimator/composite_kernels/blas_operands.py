"""The copies a matrix product's kernel makes of operands BLAS cannot read as they are laid out: a gradient
expanded from a sum or a mean (stride 0, `loss = linear(x).sum()`), a slice with a step. Such a copy is made inside
the kernel, below the dispatcher's Python layer, and freed as the op returns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from memplan.estimator.composite_kernels import _nbytes, composite_kernel_scratch

aten = torch.ops.aten

# bmm_out_or_baddbmm_ (aten/src/ATen/native/LinearAlgebra.cpp, torch 2.11-2.14) multiplies products smaller than this
# (contraction * rows * columns) in its own loop, which reads any strides.
_SMALL_BMM = 400
# bmm_out_or_baddbmm_'s bfloat16 and float16 batches go to oneDNN (`mkldnn_matmul`) where it is on: not this rule's.
_ONEDNN_DTYPES = (torch.bfloat16, torch.float16)


def _cpu_gemm_copies(mat1: torch.Tensor, mat2: torch.Tensor) -> tuple[int, ...]:
    """`addmm_impl_cpu_` (aten/src/ATen/native/LinearAlgebra.cpp, torch 2.11-2.14; mm, addmm and each matrix of a
    batched product split along its batch) into a new contiguous (rows, columns) result. The result is read as
    transposed (`transpose_c`, the operands swapped) unless it is a single column; then each operand is used as it
    is where one of its strides is 1 and the other at least the matrix's leading size:

        if (m1_strides[transpose_c ? 1 : 0] == 1 && m1_strides[transpose_c ? 0 : 1] >= std::max(int64_t{1}, m)) {
          a = m1.resolve_conj();
        } else if (m1_strides[transpose_c ? 0 : 1] == 1 && m1_strides[transpose_c ? 1 : 0] >= std::max(int64_t{1}, k)) {
          a = m1;
        } else {
          a = m1.clone(at::MemoryFormat::Contiguous);
        }

    (`b` from m2 the same way, with k and n), both held until the gemm returns. An empty result or an empty
    contraction returns before."""
    rows, depth, columns = mat1.shape[0], mat1.shape[1], mat2.shape[1]
    if rows * columns == 0 or depth == 0:
        return ()
    transpose_c = columns != 1
    first, second = (mat2, mat1) if transpose_c else (mat1, mat2)
    m, n = (columns, rows) if transpose_c else (rows, columns)
    fast, leading = (1, 0) if transpose_c else (0, 1)

    def usable(tensor: torch.Tensor, plain_leading: int, transposed_leading: int) -> bool:
        strides = tensor.stride()
        return (strides[fast] == 1 and strides[leading] >= max(1, plain_leading)) or (
            strides[leading] == 1 and strides[fast] >= max(1, transposed_leading)
        )

    copies = []
    if not usable(first, m, depth):
        copies.append(_nbytes(first))
    if not usable(second, depth, n):
        copies.append(_nbytes(second))
    return tuple(copies)


def _cuda_gemm_copies(mat1: torch.Tensor, mat2: torch.Tensor) -> tuple[int, ...]:
    """`prepare_matrix_for_cublas` (aten/src/ATen/native/cuda/Blas.cpp, from torch 2.9 cuBlasCommonArgs.h, through
    torch 2.14; mm and addmm's `cublasCommonArgs`): a non-overlapping, dense operand is used as it is (either
    order); otherwise as it is where `strides[0] == 1 && strides[1] >= max(1, sizes[0])` or
    `strides[1] == 1 && strides[0] >= max(1, sizes[1])`, else `tensor.clone(at::MemoryFormat::Contiguous)`,
    held until the product returns."""
    copies = []
    for tensor in (mat1, mat2):
        if tensor.numel() == 0 or is_non_overlapping_and_dense_or_false(tensor):
            continue
        (size0, size1), (stride0, stride1) = tensor.shape, tensor.stride()
        if (stride0 == 1 and stride1 >= max(1, size0)) or (stride1 == 1 and stride0 >= max(1, size1)):
            continue
        copies.append(_nbytes(tensor))
    return tuple(copies)


@composite_kernel_scratch(aten.mm.default, aten.addmm.default)
def matrix_product_copies(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[int, ...]:
    """mm(self, mat2) and addmm(self, mat1, mat2, *, beta, alpha): the operands' copies by the target's rule."""
    mat1, mat2 = (args[0], args[1]) if len(args) == 2 else (args[1], args[2])
    if not isinstance(mat1, torch.Tensor) or not isinstance(mat2, torch.Tensor) or mat1.dim() != 2:
        return ()
    if mat1.layout != torch.strided or mat2.layout != torch.strided:
        return ()
    return _cpu_gemm_copies(mat1, mat2) if device == "cpu" else _cuda_gemm_copies(mat1, mat2)


@composite_kernel_scratch(aten.bmm.default, aten.baddbmm.default)
def batched_product_copies(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[int, ...]:
    """bmm(self, mat2) and baddbmm(self, batch1, batch2) on the CPU, `bmm_out_or_baddbmm_` (LinearAlgebra.cpp, torch
    2.11-2.14): a small product runs its own loop; float32/float64 batches whose matrices are each contiguous or
    transposed go to MKL's batched gemm as they are; anything else is split along the batch into one
    `addmm_impl_cpu_` per matrix, whose copies (_cpu_gemm_copies, none for matrices MKL would have taken) are freed
    before the next matrix's. bfloat16 and float16 batches are left out (oneDNN's `mkldnn_matmul` takes bfloat16
    where oneDNN is on), and so is the cuda target (`prepare_batch_matrix_for_cublas`): 0 for them."""
    batch1, batch2 = (args[0], args[1]) if len(args) == 2 else (args[1], args[2])
    if device != "cpu" or not isinstance(batch1, torch.Tensor) or not isinstance(batch2, torch.Tensor):
        return ()
    if batch1.dtype in _ONEDNN_DTYPES or batch1.dim() != 3 or batch1.shape[0] == 0:
        return ()
    if batch1.shape[2] * batch1.shape[1] * batch2.shape[2] < _SMALL_BMM:
        return ()
    return _cpu_gemm_copies(batch1[0], batch2[0])
