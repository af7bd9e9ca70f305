"""What CPU ATen kernels allocate inside one op, beside its outputs: requests no dispatch mode sees (the kernel
makes them below the dispatcher's Python layer), so neither the trace's graph nor a dispatch-mode counter has
them. Each rule is a pure function of the op's arguments, with its source.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# FSDP2's reduce-scatter copy-in (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: `torch.ops.fsdp.
# chunk_cat(unsharded_grads, dim=0, num_chunks=world_size, out=reduce_scatter_input)`), which calls
# `torch._chunk_cat(..., out=)`.
CHUNK_CAT = "fsdp.chunk_cat.default"
# The ops whose CPU kernel pads so, by name: FSDP2's, and aten's own that it calls (a script may call either).
CHUNK_CAT_OPS = frozenset({CHUNK_CAT, "aten._chunk_cat.default", "aten._chunk_cat.out"})


def chunk_cat_padding_bytes(tensors: Sequence[torch.Tensor], dim: int, num_chunks: int) -> int:
    """The padded copies `_chunk_cat_out` makes on the CPU and holds together until its cat is done.

    aten/src/ATen/native/TensorShape.cpp (torch 2.11-2.14), `_pad_chunk`: a tensor whose size at `dim` is not
    a multiple of `num_chunks` is copied into `new_zeros` of that size rounded up to the next multiple, and every
    padded tensor is kept in a vector that `cat_out` reads at once. FSDP2 on a world of N ranks: each gradient
    whose first dimension N does not divide (GPT-2's 50,257-row embedding on any even world) is copied whole
    once more while its group is reduce-scattered. A CUDA build runs `_chunk_cat_out_cuda`, whose kernel writes
    the padding itself for contiguous inputs of one dtype (FSDP2's gradients): this rule is the CPU's only.
    """
    total = 0
    for tensor in tensors:
        size = tensor.shape[dim]
        if size % num_chunks:
            padded = -(-size // num_chunks) * num_chunks
            total += tensor.numel() // max(size, 1) * padded * tensor.element_size()
    return total


def chunk_cat_cast_bytes(tensors: Sequence[torch.Tensor], dim: int, num_chunks: int, out: torch.Tensor) -> list[int]:
    """The temporaries `_chunk_cat_out`'s `cat_out` makes on the CPU, one input at a time, where an input's dtype is
    not the output's: FSDP2 with a MixedPrecisionPolicy whose reduce_dtype is not its param_dtype (bfloat16
    gradients reduce-scattered in float32, torchtitan's default).

    aten/src/ATen/native/TensorShape.cpp (torch 2.11-2.14), `cat_out_cpu`: its fast paths need every input of the
    output's dtype; otherwise each input is copied into its slice of the output through a TensorIterator built with
    `promote_inputs_to_common_dtype(true)` and `cast_common_dtype_to_outputs(true)`, whose common dtype is that one
    input's, so the iterator computes into a temporary output of the slice's shape in the input's dtype and casts it
    into the slice when it is done: a request of the (padded, by chunk_cat_padding_bytes) input's size, freed before
    the next input's. Returns those sizes in turn; none where every input has the output's dtype (CUDA's kernel
    casts as it copies: this rule is the CPU's only)."""
    sizes = []
    for tensor in tensors:
        if tensor.dtype == out.dtype or tensor.numel() == 0:
            continue
        size = tensor.shape[dim]
        padded = -(-size // num_chunks) * num_chunks
        sizes.append(tensor.numel() // max(size, 1) * padded * tensor.element_size())
    return sizes
