"""Copies the CPU 2-D pooling kernels make inside themselves: each runs in the memory format its input (forward)
or its gradient (backward) suggests and copies what is not contiguous in it, which no dispatch mode sees
(memplan.estimator.composite_kernels)."""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import suggest_memory_format

from memplan.estimator.composite_kernels import composite_kernel_scratch, contiguous_copy_bytes


def _copied_bytes(tensors: list[torch.Tensor], memory_format: torch.memory_format) -> int:
    """What `tensor.contiguous(memory_format)` allocates for each of `tensors`."""
    return sum(contiguous_copy_bytes(tensor, memory_format) for tensor in tensors)


def _pool_kernel_format(tensor: torch.Tensor) -> torch.memory_format:
    """The path a CPU pooling kernel takes: `switch (tensor.suggest_memory_format())`, channels-last for a 4-D tensor
    whose strides are channels-last's (c10's `is_channels_last_strides_2d`, as torch._prims_common computes it)."""
    return suggest_memory_format(tensor) if tensor.dim() == 4 else torch.contiguous_format


@composite_kernel_scratch(
    torch.ops.aten.max_pool2d_with_indices.default,
    torch.ops.aten.avg_pool2d.default,
    torch.ops.aten._adaptive_avg_pool2d.default,
)
def pool2d_forward_input_copy(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The CPU 2-D pooling kernels (aten/src/ATen/native/cpu/MaxPoolKernel.cpp `cpu_max_pool[_channels_last]`,
    AvgPoolKernel.cpp `cpu_avg_pool2d[_channels_last]`, AdaptiveAvgPoolKernel.cpp `cpu_adaptive_avg_pool2d
    [_channels_last]`, torch 2.11-2.14) take their path by `input.suggest_memory_format()` and run on
    `input_.contiguous(memory_format)`, with the outputs the structured op laid out in that format: an input not
    contiguous in it (a strided slice, a transposed view) is copied whole while the kernel runs. CUDA's kernels are
    other code: 0 there."""
    if device != "cpu":
        return 0
    input = args[0]
    return _copied_bytes([input], _pool_kernel_format(input))


@composite_kernel_scratch(
    torch.ops.aten.max_pool2d_with_indices_backward.default,
    torch.ops.aten.avg_pool2d_backward.default,
    torch.ops.aten._adaptive_avg_pool2d_backward.default,
)
def pool2d_backward_copies(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The CPU 2-D pooling backward kernels (max_pool2d_backward_kernel_impl in aten/src/ATen/native/cpu/
    MaxPoolKernel.cpp, avg_pool2d_backward_kernel_impl in AvgPoolKernel.cpp, adapative_avg_pool2d_backward_kernel_impl
    in AdaptiveAvgPoolKernel.cpp, torch 2.11-2.14) take their path by `grad_output.suggest_memory_format()` and hold
    `grad_output_.contiguous(format)`, `indices_.contiguous(format)` (max pooling) and `grad_input_.contiguous(format)`
    at once until they return (the last copied back into grad_input_). grad_input is laid out in the *input's*
    suggested format (the ops' meta functions; `resize_as_(input, input.suggest_memory_format())` for the adaptive
    one), so where the gradient comes back in the other format (a channels-last feature map whose loss's gradient is
    contiguous; a channels-last ResNet's [N, C, 1, 1] head gradient, which suggests the default format) the kernel
    holds a second input-sized gradient and a copy of the indices: measured with torch.profiler. CUDA: 0."""
    if device != "cpu":
        return 0
    grad_output, input = args[0], args[1]
    tensors = [grad_output]
    if len(args) > 7 and isinstance(args[7], torch.Tensor):  # max_pool2d_with_indices_backward's indices
        tensors.append(args[7])
    elif isinstance(kwargs.get("indices"), torch.Tensor):
        tensors.append(kwargs["indices"])
    memory_format = _pool_kernel_format(grad_output)
    grad_input = torch.empty(input.shape, device="meta", memory_format=_pool_kernel_format(input))
    grad_input_copy = contiguous_copy_bytes(grad_input, memory_format)  # grad_input_.contiguous(format)
    return _copied_bytes(tensors, memory_format) + grad_input_copy
