"""The selective checkpointing policy: keep what is expensive to recompute, recompute the rest.

`torch.utils.checkpoint.create_selective_checkpoint_contexts` asks a policy, op by op, whether a
checkpointed region keeps an op's output (MUST_SAVE) or recomputes it in the backward
(PREFER_RECOMPUTE). memplan's policy keeps the outputs of matrix multiplications, convolutions
and attention kernels, where the FLOPs are, and recomputes pointwise ops, normalizations and
softmaxes, which are cheap to redo. The list follows torchtitan's op-level selective
checkpointing (`_save_list` in torchtitan/models/llama3/infra/parallelize.py: mm and the SDPA
kernels), widened to the other matmul and convolution overloads memplan's models reach.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

SAVED_OPS: frozenset[Any] = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.convolution.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


def save_expensive_ops(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Callable[[], Any]:
    """The `context_fn` that makes a non-reentrant checkpoint selective."""
    return functools.partial(create_selective_checkpoint_contexts, save_expensive_ops)
