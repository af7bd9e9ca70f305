"""The kernels CUDA runs where they differ from CPU's, emulated on fake CPU tensors (design.md §3).

- Scaled-dot-product attention: `select_sdpa_backend` repeats the checks of
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (`can_use_flash_attention`,
  `can_use_mem_efficient_attention`) in the default priority order of ATen/Context.h (flash,
  memory-efficient, math; cuDNN attention comes after math there, so it is never chosen unless a
  build or environment moves it forward, which memplan does not model). `sdpa_as_on_cuda` then
  calls the op attention.cpp calls for that backend: each saves what its CUDA kernel saves (output
  and logsumexp and the RNG state for flash and memory-efficient, every intermediate for math).
- Dropout: on CUDA `at::dropout` is the fused `native_dropout`, which saves a bool mask
  (Dropout.cpp, is_fused_kernel_acceptable); on CPU it multiplies by a mask of the input's dtype.
- cuBLAS workspaces: memplan.estimator.cuda.cublas.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from memplan.estimator.cuda.autocast import autocast_eligible
from memplan.gpus import DEFAULT_GPU, gpu_named


def _gemm_alignment(dtype: torch.dtype, compute_capability: tuple[int, int]) -> int:
    """sdp_utils.cpp minimum_gemm_alignment: the head-dim multiple memory-efficient attention needs."""
    major = compute_capability[0]
    half = dtype in (torch.float16, torch.bfloat16)
    if major >= 8:
        return 8 if half else 4
    if major == 7:
        return 8 if half else 1
    return 1


def select_sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    enable_gqa: bool = False,
    compute_capability: tuple[int, int] = (9, 0),
) -> str:
    """ "flash", "efficient" or "math": the backend CUDA's scaled_dot_product_attention runs."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"
    # sdp_utils.cpp check_grouped_query_attention: fewer key/value heads than query heads pass only
    # with enable_gqa, and only for backends that support it. Flash does; memory-efficient does
    # not on torch 2.11-2.14 (pytorch#139586: "only enabled on the flash attention backend"), so
    # grouped-query attention that flash rejects (fp32, a mask, sm75) runs the math backend, which
    # expands key and value to the query's heads (repeat_interleave in attention.cpp).
    equal_heads = query.shape[1] == key.shape[1] == value.shape[1]
    grouped_heads = enable_gqa and key.shape[1] == value.shape[1] and query.shape[1] % key.shape[1] == 0
    common = (
        query.shape[0] == key.shape[0] == value.shape[0]
        and min(query.shape[2], key.shape[2]) > 0
        and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (query, key, value))
    )
    dtype = query.dtype
    head_dims = (query.shape[-1], key.shape[-1], value.shape[-1])
    if (
        common
        and (equal_heads or grouped_heads)
        and attn_mask is None
        and dtype in (torch.float16, torch.bfloat16)
        and (8, 0) <= compute_capability
        and len(set(head_dims)) == 1
        and head_dims[0] <= 256
        and not (is_causal and query.shape[2] != key.shape[2])
        # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120 (training).
        and not (compute_capability in ((8, 6), (8, 9), (12, 0)) and 192 < head_dims[0] <= 224)
    ):
        return "flash"
    alignment = _gemm_alignment(dtype, compute_capability)
    efficient_dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if compute_capability >= (8, 0) else ())
    if (
        common
        and equal_heads
        and dtype in efficient_dtypes
        and (5, 0) <= compute_capability
        and head_dims[0] == head_dims[1]
        and head_dims[0] % alignment == 0
        and head_dims[2] % alignment == 0
        and (attn_mask is None or attn_mask.stride(-1) == 1)
    ):
        return "efficient"
    return "math"


def _sdpa_as_on_cuda(compute_capability: tuple[int, int]):  # type: ignore[no-untyped-def]
    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            # CUDA autocast casts sdpa's floating inputs (the mask too; float16 ones under bfloat16
            # as well, float64 never: autocast_mode.h cached_cast) before the kernel is chosen.
            low = torch.get_autocast_dtype("cpu")
            query, key, value, attn_mask = (
                t.to(low) if autocast_eligible(t) else t for t in (query, key, value, attn_mask)
            )
        backend = select_sdpa_backend(query, key, value, attn_mask, is_causal, enable_gqa, compute_capability)
        with torch.autocast("cpu", enabled=False):
            if backend == "flash":
                head_dim = query.shape[-1]
                padding = (8 - head_dim % 8) % 8  # attention.cpp pad_last_dim<8>
                og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
                q, k, v = (F.pad(t, (0, padding)) if padding else t for t in (query, key, value))
                out = torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, dropout_p, is_causal, False, scale=og_scale
                )[0]
                return out[..., :head_dim] if padding else out
            if backend == "efficient":
                if attn_mask is not None and attn_mask.dtype == torch.bool:
                    # attention.cpp convert_boolean_attn_mask: an additive mask in the query's dtype.
                    attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
                if attn_mask is not None:
                    attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
                needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
                return torch.ops.aten._scaled_dot_product_efficient_attention(
                    query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
                )[0]
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
            )[0]

    return scaled_dot_product_attention


def _dropout_as_on_cuda(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """Dropout.cpp `dropout`: the fused kernel when acceptable, otherwise `_dropout_impl`'s shortcuts."""
    if 0 < p < 1 and train and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype)


@contextlib.contextmanager
def cuda_kernels(gpu: str | None) -> Iterator[None]:
    """While active, attention and dropout run the ops CUDA would run on `gpu`."""
    compute_capability = gpu_named(gpu or DEFAULT_GPU).compute_capability
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": intended
        library.impl("dropout", _dropout_as_on_cuda, "CompositeImplicitAutograd")
    original_sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa_as_on_cuda(compute_capability)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original_sdpa
        library._destroy()
