"""`aten._safe_softmax`, the softmax of scaled_dot_product_attention's math path (`_scaled_dot_product_attention_math`
calls it on the scores: memplan.estimator.math_attention), holds a mask of the scores and of their rows beside its
output: a dispatch mode sees the op alone (memplan.estimator.composite_kernels)."""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.composite_kernels import composite_kernel_scratch


@composite_kernel_scratch(torch.ops.aten._safe_softmax.default)
def safe_softmax_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[int, ...]:
    """`_safe_softmax` is CompositeExplicitAutograd (native_functions.yaml, torch 2.11-2.14; its backward, by
    derivatives.yaml, is one `_softmax_backward_data`), one C++ function in aten/src/ATen/native/transformers/
    attention.cpp that both devices run:

        auto out = at::softmax(self, dim, dtype);
        const auto masked = self.isneginf();
        const auto masked_rows = all(masked, dim, true);
        const auto zero = at::scalar_tensor(0.0, at::TensorOptions().dtype(out.dtype()).device(out.device()));
        // reuse storage for out
        return at::where_out(out, masked_rows, zero, out);

    `out`, the output, comes first; then a bool per element (`masked`), a bool per row (`masked_rows`, the
    reduced dimension kept as 1) and a 0-d tensor of the output's dtype, all held until it returns (`where` writes
    into `out`). Measured with torch.profiler on the CPU (torch 2.11 and 2.13: isneginf, all and scalar_tensor
    allocate those sizes, where nothing) and seen in the H100 allocator trace of qwen2.5-0.5b-fp32 (torch 2.11:
    117,440,512 B, 57,344 B and 4 B after each [2, 14, 2048, 2048] float32 softmax's output)."""
    self = args[0]
    names = ("self", "dim", "dtype")
    bound = dict(zip(names, args, strict=False)) | kwargs
    dim, dtype = bound["dim"], bound.get("dtype")
    elements = self.numel()
    rows = elements // self.shape[dim] if self.dim() > 0 and self.shape[dim] else elements
    out_dtype = dtype if dtype is not None else self.dtype
    return (elements * torch.bool.itemsize, rows * torch.bool.itemsize, out_dtype.itemsize)
