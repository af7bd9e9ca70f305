"""The kernels CUDA runs where they differ from CPU's, emulated on fake CPU tensors (design.md §3).

- Scaled-dot-product attention: `select_sdpa_backend` repeats the checks of
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (`can_use_cudnn_attention`,
  `can_use_flash_attention`, `can_use_mem_efficient_attention`) in the priority order
  `priority_order` sets: ATen/Context.h's default (flash, memory-efficient, math, cuDNN last,
  so never chosen) unless `check_prefer_cudnn_attention` holds, which puts cuDNN first: a
  cuDNN newer than 9.15.0 on sm90 or sm10x (with a CUDA 12 build also only minor 0 or 3).
  Measured on the lent H100 (torch 2.11.0+cu130, cuDNN 9.19): every 16-bit SDPA call of the
  main suite ran `_scaled_dot_product_cudnn_attention`, fp32 ones the memory-efficient kernel
  (docs/validation/h100/measured-main.json, `attention_ops`). `sdpa_as_on_cuda` then calls the
  op attention.cpp calls for that backend: each saves what its CUDA kernel saves (output and
  logsumexp, and the RNG state, for cuDNN, flash and memory-efficient; every intermediate for math).
- Dropout: on CUDA `at::dropout` is the fused `native_dropout`, which saves a bool mask
  (Dropout.cpp, is_fused_kernel_acceptable); on CPU it multiplies by a mask of the input's dtype.
- cuBLAS workspaces: memplan.estimator.cuda.cublas.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from memplan.estimator.cuda.autocast import autocast_eligible
from memplan.estimator.cuda.host_tensors import efficient_attention_rng_on_host, note_on_host
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


# cuDNN releases as torch's versionRuntimeCuDNN numbers them (major * 10000 + minor * 100 + patch).
CUDNN_PREFERRED_AFTER = 91500  # sdp_utils.cpp check_prefer_cudnn_attention: "cudnn_version > 91500"
# What torch 2.11's CUDA 13 wheels load, measured on the lent H100 (docs/validation/h100/environment.json);
# assumed where the installed torch has no cuDNN (a CPU build) to say which release the GPU run has.
DEFAULT_CUDNN_VERSION = 91900
DEFAULT_CUDA_MAJOR = 13


def cudnn_attention_preferred(
    compute_capability: tuple[int, int], cudnn_version: int | None = None, cuda_major: int | None = None
) -> bool:
    """sdp_utils.cpp check_prefer_cudnn_attention (torch 2.11-2.14): cuDNN attention first in the
    priority order. Versions default to the installed torch's, else to DEFAULT_CUDNN_VERSION and
    DEFAULT_CUDA_MAJOR (TORCH_CUDNN_SDPA_DEPRIORITIZED=1 in the environment turns it off)."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on", "yes"):
        return False
    if cudnn_version is None:
        cudnn_version = _installed_cudnn_version() or DEFAULT_CUDNN_VERSION
    if cuda_major is None:
        cuda_major = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else DEFAULT_CUDA_MAJOR
    major, minor = compute_capability
    if cudnn_version <= CUDNN_PREFERRED_AFTER or major not in (9, 10):
        return False
    return cuda_major >= 13 or minor in (0, 3)


@functools.cache  # loading cuDNN to ask costs time; the installed library does not change
def _installed_cudnn_version() -> int | None:
    try:
        return torch.backends.cudnn.version() if torch.version.cuda else None
    except RuntimeError:  # a CUDA build whose cuDNN library cannot be loaded here
        return None


def _cudnn_attention_usable(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    deterministic: bool,
    heads_ok: bool,
    compute_capability: tuple[int, int],
) -> bool:
    """sdp_utils.cpp can_use_cudnn_attention for dense inputs on cuDNN 9.16-9.22 (head dims up to
    128; 256 needs a cuDNN after 9.22 with a frontend memplan cannot see). Newer sources also
    refuse a dropout that is not a multiple of 1/16 (check_cudnn_dropout); torch 2.11 does not:
    GPT-2's attention dropout of 0.1 ran cuDNN attention on the lent H100 (gpt2-amp-bf16)."""
    batch, heads, seq_q, head_dim_qk = query.shape
    seq_k, head_dim_v = key.shape[2], value.shape[-1]
    return (
        heads_ok
        and not deterministic  # check_cudnn_deterministic (warn-only mode is not modelled)
        and query.dtype in (torch.float16, torch.bfloat16)
        and (8, 0) <= compute_capability <= (12, 1)
        and batch <= 65535
        and heads <= 65535
        and head_dim_qk <= 128
        and head_dim_v <= 128
        and head_dim_qk % 8 == 0
        and head_dim_v % 8 == 0
        and seq_k != 1
        and not (dropout_p != 0.0 and seq_q == 1)
    )


def select_sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    enable_gqa: bool = False,
    compute_capability: tuple[int, int] = (9, 0),
    cudnn_preferred: bool = False,
    dropout_p: float = 0.0,
    deterministic: bool = False,
) -> str:
    """ "cudnn", "flash", "efficient" or "math": the backend CUDA's scaled_dot_product_attention runs.
    `cudnn_preferred`: whether this torch build puts cuDNN first (`cudnn_attention_preferred`)."""
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
        cudnn_preferred
        and common
        # The cuDNN op takes no gradient for its bias (derivatives.yaml), so a learned one such as
        # T5's position bias cannot go to it here. On the lent H100 t5-small ran cuDNN attention
        # nonetheless, by a path memplan has not found; its peaks matched with memory-efficient's.
        and (attn_mask is None or not attn_mask.requires_grad)
        and _cudnn_attention_usable(
            query, key, value, dropout_p, deterministic, equal_heads or grouped_heads, compute_capability
        )
    ):
        return "cudnn"
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


def _sdpa_as_on_cuda(compute_capability: tuple[int, int], deterministic: bool = False):  # type: ignore[no-untyped-def]
    cudnn_preferred = cudnn_attention_preferred(compute_capability)

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
        backend = select_sdpa_backend(
            query,
            key,
            value,
            attn_mask,
            is_causal,
            enable_gqa,
            compute_capability,
            cudnn_preferred,
            dropout_p,
            deterministic,
        )
        with torch.autocast("cpu", enabled=False):
            if backend == "cudnn":
                if attn_mask is not None and attn_mask.dtype == torch.bool:
                    # attention.cpp: cuDNN takes an additive mask in the query's dtype, as memory-efficient does.
                    attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
                needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
                return torch.ops.aten._scaled_dot_product_cudnn_attention(
                    query, key, value, attn_mask, needs_grad, dropout_p, is_causal, False, scale=scale
                )[0]
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
                outputs = torch.ops.aten._scaled_dot_product_efficient_attention(
                    query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
                )
                if efficient_attention_rng_on_host(dropout_p):
                    note_on_host(outputs[2], outputs[3])  # the philox seed and offset (host_tensors)
                return outputs[0]
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
def cuda_kernels(gpu: str | None, deterministic: bool = False) -> Iterator[None]:
    """While active, attention and dropout run the ops CUDA would run on `gpu`."""
    compute_capability = gpu_named(gpu or DEFAULT_GPU).compute_capability
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": intended
        library.impl("dropout", _dropout_as_on_cuda, "CompositeImplicitAutograd")
    original_sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa_as_on_cuda(compute_capability, deterministic)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original_sdpa
        library._destroy()
