"""Pointwise losses whose 0-d result keeps the storage of the unreduced loss, which torch's fake kernels
do not: a mean or summed MSE holds an input-sized buffer as long as the loss lives (in the loop, through
the whole backward).

- `mse_loss`, `smooth_l1_loss` (structured kernels, CPU and CUDA alike): the meta function builds a
  binary TensorIterator over (input, target), which allocates the output at their broadcast shape, then
  `maybe_get_output().resize_({})` when reduced (aten/src/ATen/native/Loss.cpp, TORCH_META_FUNC(mse_loss)
  and TORCH_META_FUNC(smooth_l1_loss), torch 2.11-2.14); the impl reduces into it, and a resize to fewer
  elements keeps the storage.
- `binary_cross_entropy`: `Tensor loss = at::empty_like(input)`, the unreduced loss written there, then
  `loss.resize_as_(loss_reduced).copy_(loss_reduced)` (binary_cross_entropy_cpu in Loss.cpp,
  binary_cross_entropy_cuda in cuda/Loss.cu).
- `soft_margin_loss`: `at::neg_out(output, input)` grows an empty output to the input's size, then
  `output.resize_({})` (Loss.cpp, soft_margin_loss_out; CompositeExplicitAutograd, any device).

Measured on torch 2.11 and 2.13 (CPU): a [4, 3, 32, 32] float32 MSE's 0-d loss holds 49,152 B, the fake
one 4 B. `l1_loss` and `huber_loss` return a fresh 0-d tensor from `mean()`/`sum()` and need no rule.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.oprules import output_bytes_rule


def _broadcast_bytes(input: torch.Tensor, target: torch.Tensor) -> int:
    """A binary TensorIterator's output over (input, target): their broadcast shape, their promoted dtype."""
    elements = torch.broadcast_shapes(input.shape, target.shape).numel()
    return elements * torch.promote_types(input.dtype, target.dtype).itemsize


@output_bytes_rule(torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default)
def binary_iterator_loss(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    input, target = args[0], args[1] if len(args) > 1 else kwargs["target"]
    return [_broadcast_bytes(input, target)]


@output_bytes_rule(torch.ops.aten.binary_cross_entropy.default, torch.ops.aten.soft_margin_loss.default)
def input_sized_loss(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    input = args[0]
    return [input.numel() * input.dtype.itemsize]
