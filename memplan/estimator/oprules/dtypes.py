"""Mixed dtypes that the real kernels refuse and torch's fake kernels let through.

A float32 batch into a model whose weights --precision bf16 stored in bfloat16 reaches `addmm(bias, x, w.t())`
with float32 `x` and bfloat16 `w`. torch's CPU and CUDA matmul kernels refuse it ("mat1 and mat2 must have the same
dtype"; cuBLAS has no mixed-dtype gemm for these ops), but the fake kernels (the meta functions) compute the
output's shape and take the first operand's dtype: the trace went on and predicted a step that cannot run.
Checked on torch 2.13's CPU kernels (tests/test_oprules_dtypes.py); CUDA's (aten/src/ATen/native/cuda/Blas.cpp)
check the same and are not run here. Convolutions are refused by the fake kernel itself, as by the real one.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.leaves import tensors_in

# The matrix products of aten (aten/src/ATen/native/LinearAlgebra.cpp, cuda/Blas.cpp): every floating operand one dtype
MATMUL_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.addbmm.default,
        torch.ops.aten.mv.default,
        torch.ops.aten.addmv.default,
        torch.ops.aten.dot.default,
    }
)


# Ops whose destination and source must share a dtype, checked in ATen's device-independent code
# (aten/src/ATen/native/TensorAdvancedIndexing.cpp: index_add's and index_copy's meta functions, `_index_put_impl_`)
# and not by torch's fake kernels: the argument positions of the two, and what the real kernel says.
_INDEX_ADD = "index_add_(): self ({}) and source ({}) must have the same scalar type"
_INDEX_COPY = "index_copy_(): self ({}) and source ({}) expected to have the same dtype"
_INDEX_PUT = (
    "Index put requires the source and destination dtypes match, got {} for the destination and {} for the source"
)
SAME_DTYPE_OPS: dict[Any, tuple[int, int, str]] = {
    torch.ops.aten.index_add.default: (0, 3, _INDEX_ADD),
    torch.ops.aten.index_add_.default: (0, 3, _INDEX_ADD),
    torch.ops.aten.index_copy.default: (0, 3, _INDEX_COPY),
    torch.ops.aten.index_copy_.default: (0, 3, _INDEX_COPY),
    torch.ops.aten.index_put.default: (0, 2, _INDEX_PUT),
    torch.ops.aten.index_put_.default: (0, 2, _INDEX_PUT),
    torch.ops.aten._index_put_impl_.default: (0, 2, _INDEX_PUT),
}


def refused_mixed_dtypes(func: Any, args: tuple) -> str | None:
    """torch's own words for the mixed floating dtypes a real matmul or indexing kernel refuses, or None."""
    if func in SAME_DTYPE_OPS:
        destination, source, message = SAME_DTYPE_OPS[func]
        if len(args) <= source or not all(isinstance(args[i], torch.Tensor) for i in (destination, source)):
            return None
        if args[destination].dtype == args[source].dtype:
            return None
        if message is _INDEX_PUT and args[source].numel() == 1:
            return None  # `x[mask] = value` with one value: index_put_ fills it as masked_fill_ does, casting it
        hint = " (a 16-bit value into a float32 tensor under autocast?)"
        return message.format(*(str(args[i].dtype).removeprefix("torch.") for i in (destination, source))) + hint
    if func not in MATMUL_OPS:
        return None
    dtypes = list(dict.fromkeys(tensor.dtype for tensor in tensors_in(args) if tensor.is_floating_point()))
    if len(dtypes) < 2:
        return None
    names = " and ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
    hint = " (a float32 batch into 16-bit weights?)" if torch.float32 in dtypes else ""
    return f"{func.name()} needs operands of one dtype, but got {names}{hint}"
