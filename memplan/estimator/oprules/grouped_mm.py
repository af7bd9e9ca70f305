"""`torch._grouped_mm` (transformers' default experts implementation for mixture-of-experts layers, "grouped_mm":
Mixtral, Qwen-MoE, DeepSeek, OLMoE, ... in transformers 5): what the real kernels accept and the output they make.

aten/src/ATen/native/GroupedMMUtils.h (torch 2.11-2.14), shared by the CPU kernel and CUDA's `_grouped_mm_cuda`:
`_grouped_mm_validate_inputs` takes float32, bfloat16 and float16 operands, 2-D or 3-D, each with one unit stride
and the other a multiple of 16 bytes, offsets (int32, 1-D) exactly where a 2-D operand is given, and no bias;
`_resolve_grouped_mm_out_dtype` makes the output in the first operand's dtype (no other is allowed); and
`create_grouped_gemm_output_tensor` pads the output's rows to 16 bytes on every build but ROCm ("for TMA
transfers"). CUDA's fast path (bfloat16 on sm90/sm100) and the fallback that loops `mm_out` over the groups both
write into that one tensor. torch's meta kernel (`_meta_grouped_mm_common`, written for the CUDA fast path) refuses
float32 and float16, which the real kernels run (a Mixtral step in float32 trains on the CPU), and pads only on a
CUDA build. Measured, torch 2.13 (CPU build) and 2.11 (CUDA build), on the CPU: [12, 8] x [3, 8, 10] with
offsets gives a [12, 10] output with row stride 12 (float32) or 16 (16-bit): 568 B and 372 B.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.oprules import OutputLayout, fake_kernel_rule

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROW_ALIGNMENT_BYTES = 16


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_strides(name: str, matrix: torch.Tensor) -> None:
    """GroupedMMUtils.h `check_valid_strides_and_return_transposed`: row- or column-major in the last two
    dimensions, the other stride a multiple of 16 bytes."""
    alignment = _ROW_ALIGNMENT_BYTES // matrix.element_size()
    rows, cols = matrix.shape[-2], matrix.shape[-1]
    row_stride, col_stride = matrix.stride()[-2], matrix.stride()[-1]
    if row_stride == 1 and col_stride >= max(1, rows):
        _check(col_stride % alignment == 0, f"{name}: strides should be multiple of 16 bytes")
    elif col_stride == 1 and row_stride >= max(1, cols):
        _check(row_stride % alignment == 0, f"{name}: strides should be multiple of 16 bytes")
    else:
        _check(False, f"{name}: invalid strides/sizes, got {list(matrix.stride())} for {list(matrix.shape)}")


def _output_sizes(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    a_is_2d, b_is_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a_is_2d and b_is_2d:
        return [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]  # type: ignore[union-attr]
    if a_is_2d:
        _check(offs.shape[0] == mat_b.shape[0], "matrix batch sizes have to match")  # type: ignore[union-attr]
        return [mat_a.shape[0], mat_b.shape[-1]]
    if b_is_2d:
        _check(offs.shape[0] == mat_a.shape[0], "matrix batch sizes have to match")  # type: ignore[union-attr]
        return [mat_a.shape[1], mat_b.shape[1]]
    _check(mat_a.shape[0] == mat_b.shape[0], "batched dimension has to match")
    return [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]


@fake_kernel_rule(torch.ops.aten._grouped_mm.default)
def grouped_mm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OutputLayout:
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args, strict=False)) | kwargs
    mat_a, mat_b = bound["mat_a"], bound["mat_b"]
    offs, bias, out_dtype = bound.get("offs"), bound.get("bias"), bound.get("out_dtype")
    for name, matrix in (("mat_a", mat_a), ("mat_b", mat_b)):
        _check(matrix.dtype in _DTYPES, f"Expected {name} to be Float32, BFloat16 or Float16, got {matrix.dtype}")
        _check(matrix.dim() in (2, 3), f"{name} has to be 2 or 3d")
    if mat_a.dim() == 3 or mat_b.dim() == 3:
        _check(mat_a.shape[-1] == mat_b.shape[-2], "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    _check(
        (offs is not None) == (mat_a.dim() == 2 or mat_b.dim() == 2),
        "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d",
    )
    if offs is not None:
        _check(offs.dim() == 1, "offs has to be 1D")
        _check(offs.dtype == torch.int32, "Offsets have to be int32")
    _check(bias is None, "Bias not supported yet")
    dtype = out_dtype or mat_a.dtype
    _check(dtype == mat_a.dtype, "Grouped gemm output dtype must match `mat_a` dtype")
    sizes = _output_sizes(mat_a, mat_b, offs)
    alignment = _ROW_ALIGNMENT_BYTES // dtype.itemsize
    padded = -(-sizes[-1] // alignment) * alignment
    strides = [padded, 1] if len(sizes) == 2 else [sizes[1] * padded, padded, 1]
    return sizes, strides, dtype
