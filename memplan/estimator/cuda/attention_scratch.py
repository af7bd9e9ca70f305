"""What CUDA's attention backward kernels allocate beyond the gradients they return.

The traced ops (`_scaled_dot_product_flash_attention_backward`, `..._efficient_attention_backward`)
produce only their gradients on fake tensors; on a GPU each call also allocates scratch through the
caching allocator and frees it when the call returns. These rules give the sizes, all requested
together and freed at the op's end (torch 2.11-2.14 sources):

Flash (aten/src/ATen/native/transformers/cuda/attention_backward.cu `_flash_attention_backward`,
flash_attn/flash_api.cpp `mha_bwd`; the tensors arrive as [batch, seq, heads, head_dim]):
- `grad_out.contiguous()` and `out.contiguous()`: a copy of each that is not contiguous in that layout;
- `softmax_d`: float32 [batch, heads, seq_q rounded up to 128], returned and dropped by the caller;
- `dq_accum`: float32 [batch, seq_q rounded to 128, heads, head_dim rounded to 32 (64 above 128)].
  Under `torch.use_deterministic_algorithms(True)` (not warn-only) it gains a leading dimension of
  ceil(multiprocessors / (batch * heads)) splits;
- grouped-query attention (fewer key/value heads): `dk_expanded` and `dv_expanded`, [batch,
  seq_k, heads, head_dim] in the input's dtype, summed into dk and dv after the kernel.

cuDNN (attention_backward.cu `_scaled_dot_product_cudnn_attention_backward_cuda`, cudnn/MHA.cpp
`run_cudnn_SDP_bprop`): after dq, dk and dv, one workspace for the cuDNN graph, sized by cuDNN and
freed when the call returns. Measured on the lent H100 (cuDNN 9.19; docs/validation/h100, the
allocator traces of six 16-bit configurations), it is float32 [batch, heads, seq_q, head_dim] (the
grad-query accumulator) plus float32 [batch, heads, seq_q] (softmax statistics) plus 256 bytes,
to the byte in GPT-2, DistilBERT, T5-small, BERT-large and ViT-base; with grouped-query attention
(Qwen2.5-0.5B: 14 query heads, 2 key/value heads) one more float32 [batch, heads, seq_q,
head_dim]. That second term rests on one measured architecture, and the 256 bytes on cuDNN's
own sizing, which no source memplan can read states.

Memory-efficient (attention_backward.cu `_efficient_attention_backward`, the cutlass kernel of
mem_eff_attention/kernel_backward.h):
- `delta`: float32 [batch, heads, seq_q]. 16-bit kernels compute it in the kernel
  (kKernelComputesDelta); float32 ones first compute `(grad_out.float() * out.float()).sum(-1)`,
  a float32 product the size of the output, freed before the kernel runs;
- the grad-query accumulator (kNeedsAccumGradQ: every kernel from sm70): float32 tiles covering
  [batch, heads, seq_q, head_dim]. memplan counts the unpadded float32 size, so this is a lower
  bound: the tile padding (64 or 128 rows, the kernel's column width) and the grad-key/value
  split-key staging (kNeedsAccumGradK/V, at most 200 / (batch * heads) splits; one split in
  deterministic mode) are not modelled.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default
CUDNN_BACKWARD = aten._scaled_dot_product_cudnn_attention_backward.default
CUDNN_WORKSPACE_EXTRA_BYTES = 256  # measured beyond the two float32 terms (see the module docstring)
EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default
FLOAT32_BYTES = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _contiguous_as_kernel_reads(tensor: torch.Tensor) -> bool:
    """Whether [batch, heads, seq, dim] transposed to [batch, seq, heads, dim] needs no copy."""
    return tensor.transpose(1, 2).is_contiguous()


def flash_backward_scratch(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    out: torch.Tensor,
    deterministic_multiprocessors: int | None = None,
) -> tuple[int, ...]:
    """Bytes requested by one flash-attention backward call besides its gradients, in request order.

    Arguments as the traced op takes them: [batch, heads, seq, head_dim], head_dim already padded
    to a multiple of 8. `deterministic_multiprocessors`: the GPU's multiprocessor count when
    deterministic algorithms are on, else None.
    """
    batch, heads, seq_q, head_dim = query.shape
    heads_k, seq_k = key.shape[1], key.shape[2]
    requests = []
    if not _contiguous_as_kernel_reads(grad_out):
        requests.append(_nbytes(grad_out))
    if not _contiguous_as_kernel_reads(out):
        requests.append(_nbytes(out))
    seq_q_rounded = _round_up(seq_q, 128)
    head_dim_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    requests.append(batch * heads * seq_q_rounded * FLOAT32_BYTES)  # softmax_d
    splits = 1
    if deterministic_multiprocessors is not None:
        splits = -(-deterministic_multiprocessors // (batch * heads))
    requests.append(splits * batch * seq_q_rounded * heads * head_dim_rounded * FLOAT32_BYTES)  # dq_accum
    if heads_k != heads:
        expanded = batch * seq_k * heads * head_dim * query.element_size()
        requests += [expanded, expanded]  # dk_expanded, dv_expanded
    return tuple(requests)


def efficient_backward_scratch(
    grad_out: torch.Tensor, query: torch.Tensor, compute_capability: tuple[int, int]
) -> tuple[int, ...]:
    """Bytes requested by one memory-efficient attention backward call while its kernel runs.

    A float32 call's delta product (the output's size, freed before the kernel) is returned
    instead when it is larger than what the kernel holds.
    """
    batch, heads, seq_q, head_dim = query.shape
    delta = batch * heads * seq_q * FLOAT32_BYTES
    accumulator = batch * heads * seq_q * head_dim * FLOAT32_BYTES if compute_capability >= (7, 0) else 0
    during_kernel = (delta, accumulator) if accumulator else (delta,)
    if grad_out.dtype == torch.float32:
        product = grad_out.numel() * FLOAT32_BYTES
        before_kernel = (product, batch * seq_q * heads * FLOAT32_BYTES)  # the product, then its sum
        if sum(before_kernel) > sum(during_kernel):
            return before_kernel
    return during_kernel


def cudnn_backward_scratch(query: torch.Tensor, key: torch.Tensor) -> tuple[int, ...]:
    """Bytes of the workspace one cuDNN attention backward call requests besides its gradients."""
    batch, heads, seq_q, head_dim = query.shape
    accumulators = 2 if key.shape[1] != heads else 1
    return (
        accumulators * batch * heads * seq_q * head_dim * FLOAT32_BYTES
        + batch * heads * seq_q * FLOAT32_BYTES
        + CUDNN_WORKSPACE_EXTRA_BYTES,
    )


def attention_backward_scratch(
    target: object, args: tuple, compute_capability: tuple[int, int], deterministic_multiprocessors: int | None = None
) -> tuple[int, ...]:
    """The scratch requests of one traced attention backward op; () for any other op."""
    if target == FLASH_BACKWARD:
        grad_out, query, key, _value, out = args[:5]
        return flash_backward_scratch(grad_out, query, key, out, deterministic_multiprocessors)
    if target == EFFICIENT_BACKWARD:
        grad_out, query = args[0], args[1]
        return efficient_backward_scratch(grad_out, query, compute_capability)
    if target == CUDNN_BACKWARD:
        return cudnn_backward_scratch(args[1], args[2])
    return ()
