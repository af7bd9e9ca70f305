"""col2im (the forward of `F.fold` and `nn.Fold`, the backward of `F.unfold`): its output keeps the storage
it was first given, the size of its input columns, where that is the larger.

Col2Im.cpp (`col2im_cpu`) and cuda/Col2Im.cu (`col2im_cuda`), torch 2.11-2.14: `Tensor output =
at::empty_like(input)`, then the template's `output.resize_({batch, channels, height, width})`; a resize to
fewer elements keeps the storage, one to more replaces it. Measured on torch 2.13 (CPU): folding [2, 27, 196]
columns into [2, 3, 16, 16] leaves a 42,336 B storage under a 6,144 B tensor; torch's fake kernel gives
6,144 B.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.oprules import output_bytes_rule


@output_bytes_rule(torch.ops.aten.col2im.default)
def col2im(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    columns, output_size, kernel_size = args[0], args[1], args[2]
    batched = columns.dim() == 3
    channels = columns.shape[-2] // (kernel_size[0] * kernel_size[1])
    output = (columns.shape[0] if batched else 1) * channels * output_size[0] * output_size[1]
    return [max(columns.numel(), output) * columns.dtype.itemsize]
