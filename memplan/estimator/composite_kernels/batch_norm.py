"""The per-channel temporaries the CPU batch norm kernels hold inside themselves (aten/src/ATen/native/
Normalization.cpp and aten/src/ATen/native/cpu/batch_norm_kernel.cpp, torch 2.11-2.14), which no dispatch mode sees.
CUDA's kernels (cuDNN's, its own) are not this code: 0 there.

The forward (`batch_norm_cpu`) makes its output first, then, training, the statistics (`batch_norm_cpu_update_stats_
template`), then writes the output (`batch_norm_cpu_transform_input_template`); each phase's temporaries are freed
before the next, so the op holds the larger of the two beside its outputs. The kernels run the channels-last code for
a channels-last input and for a contiguous one whose image is a single element (a 2-D `(N, C)` input: "NC11 is also
channels last"); that code reduces through one row of C per intra-op thread.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator import composite_kernels
from memplan.estimator.composite_kernels import (
    _LOW_PRECISION,
    _nbytes,
    bound_arguments,
    composite_kernel_scratch,
    kernel_scratch_bytes,
    mean_input_cast,
    opmath_dtype,
)
from memplan.estimator.memory_formats import contiguous_in_a_format, prims_suggest_memory_format


def _mixed(input: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """ATen's `is_mixed_type` (aten/src/ATen/native/cpu/mixed_data_type.h): a 16-bit input with float32
    parameters."""
    return input.dtype in _LOW_PRECISION and any(p is not None and p.dtype == torch.float32 for p in params)


def _channels_last_kernel(input: torch.Tensor) -> bool:
    """Whether batch_norm_kernel.cpp runs its channels-last code for `input` (contiguous in a format): a
    channels-last input, or a contiguous one whose image (`numel / N / C`) is one element."""
    return not input.is_contiguous() or input.numel() // (input.shape[0] * input.shape[1]) == 1


def _forward_scratch(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
) -> int:
    """What `batch_norm_cpu` holds at its fullest beside its three outputs.

    Statistics (training), where the input is contiguous in a format: `_mean` and `_var_sum`, [C] each in the
    parameters' dtype (`param_t`: float32 where mixed, else the input's), held while the collect-stats kernel runs;
    its channels-last code adds `at::zeros({num_threads, C})` (the input's dtype, float32 for a 16-bit one) where the
    input has more than `num_threads` rows. Otherwise `save_mean` is `at::mean(input, dims, dtype=param_t)` (an
    output), holding what that mean holds inside itself before `save_var` (a [C] output) exists.

    Output, where input, weight, bias and running stats are contiguous (`all_contiguous`): the kernel's `alpha` and
    `beta`, [C] each in the opmath dtype. Otherwise a TensorIterator reads the statistics in place; in evaluation
    `1 / at::sqrt(running_var + eps)` holds the sum, its square root and the reciprocal at once (the reciprocal then
    kept), and a missing weight or bias is a 0-d tensor of `param_t`.
    """
    if input.dim() < 2 or input.numel() == 0:
        return 0
    channels = input.shape[1]
    param_dtype = torch.float32 if _mixed(input, weight, bias, running_mean, running_var) else input.dtype
    param_item = param_dtype.itemsize
    stats = 0
    if training:
        if contiguous_in_a_format(input):
            buffer = 0
            rows = input.numel() // channels
            threads = composite_kernels.INTRA_OP_THREADS
            if _channels_last_kernel(input) and rows > threads:
                buffer = threads * channels * opmath_dtype(input.dtype).itemsize
            stats = 2 * channels * param_item + buffer
        else:
            dims = [0, *range(2, input.dim())]
            stats = max(0, mean_input_cast((input, dims), {"dtype": param_dtype}, "cpu") - channels * param_item)
    all_contiguous = contiguous_in_a_format(input) and all(
        t is None or t.is_contiguous() for t in (weight, bias, running_mean, running_var)
    )
    if all_contiguous:
        transform = 2 * channels * opmath_dtype(input.dtype).itemsize
    else:
        scalars = param_item * ((weight is None) + (bias is None))
        if training or running_var is None:
            transform = scalars
        else:
            invstd = channels * running_var.element_size()
            transform = max(3 * invstd, invstd + scalars)
    return max(stats, transform)


@composite_kernel_scratch(torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default)
def batch_norm_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`native_batch_norm` and `_native_batch_norm_legit` (batch_norm_cpu): _forward_scratch."""
    if device != "cpu":
        return 0
    b = bound_arguments(torch.ops.aten.native_batch_norm.default, args, kwargs)
    return _forward_scratch(b["input"], b["weight"], b["bias"], b["running_mean"], b["running_var"], b["training"])


@composite_kernel_scratch(torch.ops.aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`_native_batch_norm_legit.no_stats` (batch_norm_cpu without running statistics): _forward_scratch."""
    if device != "cpu":
        return 0
    b = bound_arguments(torch.ops.aten._native_batch_norm_legit.no_stats, args, kwargs)
    return _forward_scratch(b["input"], b["weight"], b["bias"], None, None, b["training"])


@composite_kernel_scratch(
    torch.ops.aten._native_batch_norm_legit_no_training.default, torch.ops.aten._batch_norm_no_update.default
)
def batch_norm_evaluation_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The overloads that run batch_norm_cpu with `train=false`: _forward_scratch."""
    if device != "cpu":
        return 0
    # the two schemas name their arguments alike
    b = bound_arguments(torch.ops.aten._batch_norm_no_update.default, args, kwargs)
    return _forward_scratch(b["input"], b["weight"], b["bias"], b["running_mean"], b["running_var"], False)


@composite_kernel_scratch(torch.ops.aten._batch_norm_with_update.default)
def batch_norm_with_update_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`_batch_norm_with_update` (_batch_norm_with_update_cpu: batch_norm_cpu with `train=true`): _forward_scratch."""
    if device != "cpu":
        return 0
    b = bound_arguments(torch.ops.aten._batch_norm_with_update.default, args, kwargs)
    return _forward_scratch(b["input"], b["weight"], b["bias"], b["running_mean"], b["running_var"], True)


@composite_kernel_scratch(torch.ops.aten.native_batch_norm_backward.default)
def batch_norm_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The CPU batch norm backward (Normalization.cpp, batch_norm_backward_cpu_template) allocates `grad_input =
    at::empty_like(input, ...)` first, then grad_weight and grad_bias; where input and grad_out are both contiguous
    in one memory format (its `all_contiguous`, the usual case) it allocates `grad_input = at::empty_like(input,
    ...)` again before the kernel runs, and the first is freed only as that assignment replaces it: an input-sized
    buffer beside the three outputs (measured with torch.profiler: a [4, 16, 14, 14] float32 input's 50,176 B twice).
    Then the kernel: its channels-last code (a channels-last input, or a 2-D one) holds `at::ones({C})` for a missing
    weight, a [C] invstd in evaluation and `at::zeros({2, num_threads, C})` (float and double inputs, in their
    dtype), or float32 copies of weight, mean and invstd ([C] each) and that buffer in float32 (16-bit inputs); the
    contiguous code holds nothing. The other path (a channels-last input whose gradient comes back in the default
    format) allocates grad_input once and holds `at::sum(grad_out_, reduce_dims)`, one grad_out-typed element per
    channel, until it returns."""
    if device != "cpu":
        return 0
    bound = bound_arguments(torch.ops.aten.native_batch_norm_backward.default, args, kwargs)
    output_mask = bound["output_mask"]
    grad_out, input = bound["grad_out"], bound["input"]
    if not isinstance(grad_out, torch.Tensor) or input.numel() == 0:
        return 0
    # `is_contiguous` of aten/src/ATen/native/batch_norm.h: contiguous in the default or a channels-last format; and
    # `input.suggest_memory_format() == grad_out_.suggest_memory_format()`, the formats their strides' order suggests
    # (c10's, torch._prims_common's twin): a [N, C, 1, 1] input with channels-last strides, contiguous both ways, and
    # a gradient with the default strides are not all_contiguous (measured: the sum's one element a channel, no second
    # grad_input; tests/test_batch_norm_scratch.py)
    all_contiguous = (
        contiguous_in_a_format(input)
        and contiguous_in_a_format(grad_out)
        and prims_suggest_memory_format(input) == prims_suggest_memory_format(grad_out)
    )
    if not all_contiguous:  # the sum's output and what that sum holds inside itself
        dims = [0, *range(2, input.dim())]
        inner = kernel_scratch_bytes(torch.ops.aten.sum.dim_IntList, (grad_out, dims), {}, device)
        return input.shape[1] * grad_out.element_size() + inner
    replaced = _nbytes(input) if output_mask[0] else 0
    if not _channels_last_kernel(input):
        return replaced
    channels, threads = input.shape[1], composite_kernels.INTRA_OP_THREADS
    weight = bound.get("weight")
    if input.dtype in _LOW_PRECISION:
        kernel = 3 * channels * 4 + 2 * threads * channels * 4
    else:
        item = input.element_size()
        ones = channels * item if weight is None else 0
        invstd = 0 if bound["train"] else channels * item
        kernel = ones + invstd + 2 * threads * channels * item
    return max(replaced, kernel)
