"""What CUDA's dense embedding backward allocates inside itself besides the gradient it returns.

The traced op, `embedding_dense_backward`, produces only `grad_weight` on fake tensors; on a GPU the kernel
(torch 2.11-2.14) sorts the indices and sums the gradient rows per partial segment through the caching
allocator, all freed when the op returns:

aten/src/ATen/native/cuda/Embedding.cu `embedding_dense_backward_cuda`:
- `indices_.contiguous()` and `grad_.contiguous()`: a copy of each that is not contiguous;
- up to 3,072 indices without `scale_grad_by_freq`: `embedding_backward_feature_kernel` into the zeroed
  gradient, nothing more;
- otherwise `sorted_indices` and `orig_indices` (`empty_like(indices)`), `range` (`arange(num_indices)`) and
  cub's radix-sort storage, the last two freed after the sort; with `scale_grad_by_freq` a `count` like the
  indices; then `embedding_backward_cuda_kernel`.

aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu `embedding_backward_cuda_kernel` (N indices of
index type I, a gradient of D features, V = num_weights rows; NROWS_PER_THREAD = 10):
- `grad_weight = at::zeros({V, D})` (the op's output), `segment_offsets` [N] of I, `num_of_segments_tensor`
  (one int64), cub's unique-by-key keys and storage (freed);
- `max_segments` = min(N, V): `partials_per_segment` and `partials_per_segment_offset` [max_segments] of I,
  cub's exclusive-sum storage (freed), `num_of_partial_segments_tensor` (one int64);
- `max_partial_segment` = N / 10 + max_segments: `partial_segment_offset` [max_partial_segment] of I;
- then either the two-pass path, `grad_weight_per_segment` [max_partial_segment, D] in the gradient's op-math
  type (float32 for float16 and bfloat16): N/10 + min(N, V) rows of D floats, the size of the incoming
  gradient in float32 and a tenth more — or, where `sum_and_scatter` would launch fewer than 4 blocks per
  multiprocessor (`use_fused_kernel`, pytorch#172454, January 2026; never under deterministic algorithms),
  `partial_to_segment_idx` [max_partial_segment] of I and, for a 16-bit gradient, a float32 `grad_weight_acc`
  [V, D] that is copied into the output.

Measured on the lent H100 (torch 2.11.0+cu130; docs/validation/h100/traces-main.tar.gz): the allocator
traces hold these requests to the byte, e.g. gpt2-bf16 (16 x 1024 tokens, 768 features, 50,257 rows):
131,072 B for each N-sized int64 array, 144,176 B for `partial_segment_offset` (18,022 x 8) and 55,363,584 B
for `grad_weight_per_segment` (18,022 x 768 x 4); bert-large's two-row token-type embedding took the fused
path (two 6,568 B index arrays, no per-segment rows).

The rule returns the requests held together at the op's fullest point beside its output (the last one made);
the sort's moment before the output exists (`sorted_indices`, `orig_indices`, `range` and cub's storage) is
returned instead where it is larger than that (only when the output is small: cub's own storage, sized by cub,
is left out of it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

EMBEDDING_DENSE_BACKWARD = torch.ops.aten.embedding_dense_backward.default

FEATURE_KERNEL_MAX_INDICES = 3072  # Embedding.cu: `num_indices <= 3072 && !scale_grad_by_freq`
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu
WARP_SIZE = 32  # at::cuda::warp_size() on NVIDIA GPUs
MAX_BLOCK_SIZE = 1024  # SortingCommon.cuh, CUDA builds
MAX_ATOMIC_ACCUM_BLOCKS_PER_SM = 4  # EmbeddingBackwardKernel.cu
INT64_BYTES = 8
_OP_MATH = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
# The most requests one call holds at once: two contiguous copies, sorted and original indices, the count, six
# index arrays and the fused path's two (EmbeddingBackwardCall.requests).
REQUEST_SLOTS = 13


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EmbeddingBackwardCall:
    """One CUDA `embedding_dense_backward` call as its kernel sizes its requests (module docstring): what a timeline
    keeps of it, so that one interpolated to another batch size sizes them anew (memplan.estimator.interpolate; they
    are not affine in the batch: `N / 10 + min(N, V)` rows). `part`: which of the call's requests this is."""

    num_indices: int
    grad_numel: int
    features: int
    grad_dtype: torch.dtype
    index_bytes: int
    num_weights: int
    scale_grad_by_freq: bool
    indices_contiguous: bool
    grad_contiguous: bool
    multiprocessors: int
    deterministic: bool
    part: int = 0

    # what the batch scales; every other field stays (memplan.estimator.interpolate)
    SCALED_FIELDS = ("num_indices", "grad_numel")

    def requests(self) -> tuple[int, ...]:
        """Bytes of each request the call holds beside its output at its fullest point; () where it runs the
        feature kernel on contiguous inputs."""
        num_indices, index_bytes, features = self.num_indices, self.index_bytes, self.features
        copies = []
        if not self.indices_contiguous:
            copies.append(num_indices * index_bytes)
        if not self.grad_contiguous:
            copies.append(self.grad_numel * self.grad_dtype.itemsize)
        if num_indices <= FEATURE_KERNEL_MAX_INDICES and not self.scale_grad_by_freq:
            return tuple(copies)
        sorted_and_orig = [num_indices * index_bytes] * 2
        count = [num_indices * index_bytes] if self.scale_grad_by_freq else []
        max_segments = min(num_indices, self.num_weights)
        max_partial_segment = num_indices // NROWS_PER_THREAD + max_segments
        kernel = [
            num_indices * index_bytes,  # segment_offsets
            INT64_BYTES,  # num_of_segments_tensor
            max_segments * index_bytes,  # partials_per_segment
            max_segments * index_bytes,  # partials_per_segment_offset
            INT64_BYTES,  # num_of_partial_segments_tensor
            max_partial_segment * index_bytes,  # partial_segment_offset
        ]
        stride_warped = _ceil_div(features, WARP_SIZE) * WARP_SIZE
        block = min(stride_warped, MAX_BLOCK_SIZE)
        sum_scatter_grid = _ceil_div(max_segments * stride_warped, block)
        fused = (
            sum_scatter_grid < self.multiprocessors * MAX_ATOMIC_ACCUM_BLOCKS_PER_SM
            and max_partial_segment > sum_scatter_grid * 4
            and not self.deterministic
        )
        op_math_bytes = _OP_MATH.get(self.grad_dtype, self.grad_dtype).itemsize
        if fused:
            kernel.append(max_partial_segment * index_bytes)  # partial_to_segment_idx
            if self.grad_dtype in _OP_MATH:
                kernel.append(self.num_weights * features * op_math_bytes)  # grad_weight_acc
        else:
            kernel.append(max_partial_segment * features * op_math_bytes)  # grad_weight_per_segment
        beside_output = (*copies, *sorted_and_orig, *count, *kernel)
        output = self.num_weights * features * self.grad_dtype.itemsize
        sort = (*copies, *sorted_and_orig, num_indices * index_bytes)  # sorted, orig and range, before the output
        return sort if sum(sort) > sum(beside_output) + output else beside_output

    def bytes(self) -> int:
        """This part's bytes (0 where the call has no such request)."""
        requests = self.requests()
        return requests[self.part] if self.part < len(requests) else 0


def embedding_backward_call(
    grad: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    scale_grad_by_freq: bool,
    multiprocessors: int,
    deterministic: bool = False,
) -> EmbeddingBackwardCall:
    """The call of these arguments (its first request; `requests()` gives them all)."""
    return EmbeddingBackwardCall(
        num_indices=indices.numel(),
        grad_numel=grad.numel(),
        features=grad.shape[-1] if grad.dim() else 1,
        grad_dtype=grad.dtype,
        index_bytes=indices.element_size(),
        num_weights=num_weights,
        scale_grad_by_freq=scale_grad_by_freq,
        indices_contiguous=indices.is_contiguous(),
        grad_contiguous=grad.is_contiguous(),
        multiprocessors=multiprocessors,
        deterministic=deterministic,
    )


def embedding_backward_requests(
    args: tuple, multiprocessors: int, deterministic: bool = False
) -> tuple[EmbeddingBackwardCall, ...]:
    """REQUEST_SLOTS EmbeddingBackwardCalls of a traced `embedding_dense_backward(grad_output, indices,
    num_weights, padding_idx, scale_grad_by_freq)` node's arguments, one per `part`: its requests in order, then
    parts of 0 bytes (module docstring)."""
    grad, indices, num_weights = args[0], args[1], args[2]
    scale_grad_by_freq = bool(args[4]) if len(args) > 4 else False
    if not isinstance(grad, torch.Tensor) or not isinstance(indices, torch.Tensor):
        return ()
    call = embedding_backward_call(grad, indices, int(num_weights), scale_grad_by_freq, multiprocessors, deterministic)
    return tuple(replace(call, part=part) for part in range(REQUEST_SLOTS))
