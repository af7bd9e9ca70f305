"""Scratch of the CPU flash attention kernels (`_scaled_dot_product_flash_attention_for_cpu` and its backward):
per-thread blocks and a copy of the gradient, allocated inside the kernel, which no dispatch mode sees
(memplan.estimator.composite_kernels)."""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator import composite_kernels
from memplan.estimator.composite_kernels import _LOW_PRECISION, _nbytes, composite_kernel_scratch, opmath_dtype


def _flash_cpu_split_sizes(q_len: int, kv_len: int) -> tuple[int, int]:
    """(qSplitSize, kvSplitSize) of the CPU flash attention kernels (aten/src/ATen/native/cpu/
    FlashAttentionKernel.cpp, flash_attention_kernel_impl and its backward, torch 2.11-2.14): query blocks of 256
    rows from 768 query positions on, of 64 from 192, else of 32; key blocks of 512; each at most the length."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


@composite_kernel_scratch(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
def flash_attention_cpu_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`cpu_flash_attention` (FlashAttentionKernel.cpp, torch 2.11-2.14), after its output and logsumexp, allocates
    one block of scratch per intra-op thread: `buf` of [num_thread, qSplitSize * kvSplitSize (qk) + 2 * qSplitSize
    (qk_max, qk_sum) + qSplitSize * headSize (dst)] in the accumulate type, and, for float16/bfloat16,
    `buf_reduced` of [num_thread, qSplitSize, kvSplitSize] in the query's type; both held until it returns.
    (The oneDNN packing path, float16 on CPUs with AMX-FP16, pads those sizes and keeps its packed copies outside
    the CPU allocator: not modelled.)"""
    if device != "cpu":
        return 0
    query, key = args[0], args[1]
    q_split, kv_split = _flash_cpu_split_sizes(query.shape[2], key.shape[2])
    per_thread = (q_split * kv_split + 2 * q_split + q_split * query.shape[3]) * opmath_dtype(query.dtype).itemsize
    if query.dtype in _LOW_PRECISION:
        per_thread += q_split * kv_split * query.element_size()
    return composite_kernels.INTRA_OP_THREADS * per_thread


@composite_kernel_scratch(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def flash_attention_cpu_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The CPU flash attention backward (FlashAttentionKernel.cpp, torch 2.11-2.14), after its three zeroed
    gradients (attention.cpp, `_scaled_dot_product_flash_attention_cpu_backward`), holds until it returns:
    - `grad_out.contiguous()` of the gradient transposed to [batch, seq, heads, head_dim]
      (flash_attention_backward_kernel_impl): a copy of the whole gradient unless it arrives as a transposed view
      of that layout (as transformers' attention modules give it back). A gradient in the [batch, heads, seq,
      head_dim] layout itself, or broadcast (a sum over the output), is copied: a per-sample buffer;
    - per intra-op thread, `buf` of 2 * qSplitSize * kvSplitSize (attn, grad_attn) in the accumulate type and, for
      float16/bfloat16, `buf_reduced` of as many in the query's type;
    - in each thread's share of the batch × heads loop, `dsum` of qSplitSize in the accumulate type.
    """
    if device != "cpu":
        return 0
    grad_out, query, key = args[0], args[1], args[2]
    if not isinstance(grad_out, torch.Tensor):
        return 0
    copy = 0 if grad_out.transpose(1, 2).is_contiguous() else _nbytes(grad_out)
    q_split, kv_split = _flash_cpu_split_sizes(query.shape[2], key.shape[2])
    accumulate = opmath_dtype(query.dtype).itemsize
    per_thread = 2 * q_split * kv_split * accumulate
    if query.dtype in _LOW_PRECISION:
        per_thread += 2 * q_split * kv_split * query.element_size()
    threads = composite_kernels.INTRA_OP_THREADS
    working_threads = max(min(threads, query.shape[0] * query.shape[1]), 1)
    return copy + threads * per_thread + working_threads * q_split * accumulate
