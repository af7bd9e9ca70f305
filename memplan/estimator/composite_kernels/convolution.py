"""Scratch of the CPU convolutions that oneDNN does not run: ATen's Slow2d backend (`thnn_conv2d`,
`_slow_conv2d_backward`) allocates its im2col columns and the contiguous copies it works on inside the kernel, which
no dispatch mode sees (memplan.estimator.composite_kernels)."""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator import composite_kernels
from memplan.estimator.composite_kernels import _nbytes, composite_kernel_scratch, contiguous_copy_bytes
from memplan.estimator.memory_formats import meta_like, suggested_memory_format

_SUM = torch.ops.aten.sum.dim_IntList


def _subtensor(tensor: torch.Tensor, dim: int, groups: int, g: int) -> torch.Tensor:
    """The view Convolution.cpp's `subtensor` narrows, `tensor.narrow(dim, n * g, n)`, before its
    `.contiguous(tensor.suggest_memory_format())` (a copy unless the view is contiguous in that format)."""
    n = tensor.shape[dim] // groups
    return tensor.narrow(dim, n * g, n)


def _expanded(param: Any, dims: int) -> list[int]:
    """Convolution.cpp's `expand_param_if_needed`: a one-element stride, padding or dilation stands for every spatial
    dimension (`torch.ops.aten.convolution(x, w, None, [1], [1], [1], ...)` runs a 2-D convolution)."""
    values = [int(value) for value in param]
    return values * dims if len(values) == 1 else values


def mkldnn_runs(input: torch.Tensor, weight: torch.Tensor, stride: list[int], dilation: list[int], groups: int) -> bool:
    """`ConvParams::use_mkldnn` (aten/src/ATen/native/Convolution.cpp, torch 2.11-2.14; `input`, `weight` 4-D, as
    `_convolution` views a 1-D convolution before it selects its backend): 16-bit floats where the CPU has oneDNN's
    kernels for them; float32 unless it is a small one that THNN runs faster: a 1x1, unstrided, undilated kernel on
    one thread under a batch of 16, or one group, a kernel of 3 or less on a side, a batch of 1 and at most 20,480
    input elements (measured: a [1, 8, 16, 16] 3x3 convolution runs thnn_conv2d with oneDNN on). A 1-D one's
    [N, C, L] input and [O, I, k] weight read as their [N, C, 1, L] and [O, I, 1, k] views (a size-1 dimension
    changes neither the element count nor a kernel side that matters)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if input.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if input.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    if input.dtype != torch.float32:
        return False
    batch = input.shape[0]
    kernel = (weight.shape[-2], weight.shape[-1]) if weight.dim() == 4 else (1, weight.shape[-1])
    strided_or_dilated = any(s != 1 for s in stride) or any(d != 1 for d in dilation)
    not_one_by_one = strided_or_dilated or batch >= 16 or kernel != (1, 1) or composite_kernels.INTRA_OP_THREADS > 1
    large = groups > 1 or (kernel[0] > 3 and kernel[1] > 3) or batch > 1 or input.numel() > 20480
    return not_one_by_one and large


def _slow_conv2d_backend(args: tuple[Any, ...], transposed: bool, groups: int) -> bool:
    """Whether ATen's CPU `_select_conv_backend` (aten/src/ATen/native/Convolution.cpp, torch 2.11-2.14) takes
    Slow2d (`thnn_conv2d` / `_slow_conv2d_backward`) for this convolution in this process: a 1-D or 2-D, undilated,
    untransposed convolution that oneDNN does not run (mkldnn_runs) and NNPACK does not either (`use_nnpack`:
    float32, kernel under 17, padding under the kernel, a batch of 16 or more; its backward runs the dilated
    kernel)."""
    input, weight = args[0], args[1]
    if transposed or input.dim() not in (3, 4) or input.numel() == 0:
        return False
    spatial = input.dim() - 2
    stride, padding, dilation = (_expanded(args[i], spatial) for i in (3, 4, 5))
    if any(d != 1 for d in dilation):
        return False
    kernel = weight.shape[2:]
    padding2d = padding if input.dim() == 4 else [0, *padding]
    kernel2d = [*kernel] if input.dim() == 4 else [1, *kernel]
    if mkldnn_runs(input, weight, stride, dilation, groups):
        return False
    nnpack = (
        torch.backends.nnpack.is_available()
        and torch._C._get_nnpack_enabled()
        and input.dtype == torch.float32
        and input.dim() == 4
        and all(k < 17 for k in kernel2d)
        and all(p < k for p, k in zip(padding2d, kernel2d, strict=True))
        and input.shape[0] >= 16
    )
    return not nnpack


def _columns_bytes(input: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int]) -> int:
    """`compute_columns2d` (aten/src/ATen/native/ConvolutionMM2d.cpp): the im2col buffer `at::empty({batch,
    channels * kh * kw, oh * ow})`, in either memory format, except a 1x1 kernel at stride 1 and no padding, whose
    columns are a view of the input. `input`, `weight` 4-D (a 1-D convolution viewed as 2-D)."""
    kh, kw = weight.shape[2], weight.shape[3]
    if (kh, kw) == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0]:
        return 0
    oh = (input.shape[2] + 2 * padding[0] - kh) // stride[0] + 1
    ow = (input.shape[3] + 2 * padding[1] - kw) // stride[1] + 1
    return input.shape[0] * input.shape[1] * kh * kw * oh * ow * input.element_size()


def _as_2d(
    input: torch.Tensor, weight: torch.Tensor, stride: Any, padding: Any
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], int]:
    """Convolution.cpp's 1-D to 2-D view (`input.contiguous()`, then view4d: a [N, C, 1, L] input), and the bytes
    of that contiguous copy; 2-D arguments as they are."""
    input, weight = meta_like(input), meta_like(weight)
    stride, padding = _expanded(stride, input.dim() - 2), _expanded(padding, input.dim() - 2)
    if input.dim() == 4:
        return input, weight, stride, padding, 0
    copy = contiguous_copy_bytes(input, torch.contiguous_format)
    return input.contiguous().unsqueeze(2), weight.unsqueeze(2), [1, *stride], [0, *padding], copy


def _thnn_format(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """`thnn_conv_use_channels_last` (ConvUtils.h): channels-last where the input's or the weight's suggested
    format is."""
    channels_last = torch.channels_last in (suggested_memory_format(input), suggested_memory_format(weight))
    return torch.channels_last if channels_last else torch.contiguous_format


@composite_kernel_scratch(torch.ops.aten.convolution.default)
def slow_conv2d_forward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """A CPU convolution on the Slow2d backend (_slow_conv2d_backend), torch 2.11-2.14.

    `_convolution` (Convolution.cpp) makes the input and weight contiguous in the backend's format (channels-last
    where either is: determine_backend_memory_format), then, with one group, calls `thnn_conv2d`, whose
    `slow_conv2d_forward_out_cpu` (ConvolutionMM2d.cpp) allocates the im2col columns before its output and frees
    them as it returns. With several groups (the backends without groups), each group's `subtensor` of the input
    and weight (a narrowed `.contiguous(format)`: a copy unless already contiguous) and its columns are held beside
    the outputs of the groups before it, and `at::cat(outputs, 1)` makes the output while all of them are alive.
    Measured with torch.profiler (oneDNN off): a [2, 8, 16, 16] float32 input, 3x3 to 16 channels, holds 147,456 B
    beside its 32,768 B output; depthwise, 20,480 B beside 16,384 B."""
    if device != "cpu":
        return 0
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
    bound = dict(zip(names, args, strict=False)) | kwargs
    groups, transposed = bound["groups"], bound["transposed"]
    if not _slow_conv2d_backend(tuple(bound[name] for name in names[:6]), transposed, groups):
        return 0
    input, weight, stride, padding, held = _as_2d(bound["input"], bound["weight"], bound["stride"], bound["padding"])
    memory_format = _thnn_format(input, weight)
    held += contiguous_copy_bytes(input, memory_format) + contiguous_copy_bytes(weight, memory_format)
    input, weight = input.contiguous(memory_format=memory_format), weight.contiguous(memory_format=memory_format)
    if groups == 1:
        return held + _columns_bytes(input, weight, stride, padding)
    input_g, weight_g = _subtensor(input, 1, groups, 0), _subtensor(weight, 0, groups, 0)
    copies = contiguous_copy_bytes(input_g, suggested_memory_format(input)) + contiguous_copy_bytes(
        weight_g, suggested_memory_format(weight)
    )
    oh = (input.shape[2] + 2 * padding[0] - weight.shape[2]) // stride[0] + 1
    ow = (input.shape[3] + 2 * padding[1] - weight.shape[3]) // stride[1] + 1
    output = input.shape[0] * weight.shape[0] * oh * ow * input.element_size()
    # the last group: the groups' outputs (the output's bytes in all) and its copies and columns; then the cat
    return held + max(copies + _columns_bytes(input_g, weight_g, stride, padding), output)


@composite_kernel_scratch(torch.ops.aten.convolution_backward.default)
def slow_conv2d_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The backward of a CPU convolution on the Slow2d backend (_slow_conv2d_backend), torch 2.11-2.14.

    `convolution_backward` (Convolution.cpp) makes the input and weight contiguous in the backend's format; with one
    group `_slow_conv2d_backward` (ConvolutionMM2d.cpp) computes the input's gradient from `grad_output.contiguous(
    format)` (its per-thread im2col buffer is `std::make_unique`, not the tensor allocator's), then the bias's, then
    the weight's from `grad_output.contiguous(format)` again and `compute_columns2d(input)`, both held beside the
    three gradients until it returns. With several groups, each group's `subtensor` of grad_output, input and weight
    (copies unless contiguous) and its columns are held beside the gradients of the groups before it, and the
    `at::cat`s make the gradients while all the groups' are alive. Measured with torch.profiler (oneDNN off): 3x3
    over a [2, 8, 16, 16] float32 input to 16 channels, 147,456 B beside its gradients."""
    if device != "cpu":
        return 0
    names = (
        "grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed",
        "output_padding", "groups", "output_mask",
    )  # fmt: skip
    bound = dict(zip(names, args, strict=False)) | kwargs
    grad_output, groups, mask = bound["grad_output"], bound["groups"], bound["output_mask"]
    selection = (bound["input"], bound["weight"], None, bound["stride"], bound["padding"], bound["dilation"])
    if not isinstance(grad_output, torch.Tensor) or not _slow_conv2d_backend(selection, bound["transposed"], groups):
        return 0
    input, weight, stride, padding, held = _as_2d(bound["input"], bound["weight"], bound["stride"], bound["padding"])
    grad_output = meta_like(grad_output)
    if grad_output.dim() == 3:
        grad_output = grad_output.unsqueeze(2)
    memory_format = _thnn_format(input, weight)
    held += contiguous_copy_bytes(input, memory_format) + contiguous_copy_bytes(weight, memory_format)
    input, weight = input.contiguous(memory_format=memory_format), weight.contiguous(memory_format=memory_format)
    if groups == 1:
        grad_output_copy = contiguous_copy_bytes(grad_output, memory_format)
        columns = _columns_bytes(input, weight, stride, padding)
        # the bias's `at::sum_out(grad_bias, grad_output_, {0, 2, 3})` runs before the weight's gradient exists: a
        # 16-bit one sums float32 copies (reductions.sum_float_buffer_bytes; measured: a bfloat16 [2, 16, 6, 6]
        # gradient held 4,672 B beside its bias's 32 B)
        contiguous = grad_output.contiguous(memory_format=memory_format)
        bias_sum = composite_kernels.kernel_scratch_bytes(_SUM, (contiguous, [0, 2, 3]), {}, device)
        bias_stage = grad_output_copy + bias_sum - (_nbytes(weight) if mask[1] else 0)
        return held + max(
            grad_output_copy if mask[0] else 0,
            grad_output_copy + columns if mask[1] else 0,
            bias_stage if mask[2] else 0,
        )
    grad_output_g = _subtensor(grad_output, 1, groups, 0)
    input_g, weight_g = _subtensor(input, 1, groups, 0), _subtensor(weight, 0, groups, 0)
    copies = (
        contiguous_copy_bytes(grad_output_g, suggested_memory_format(grad_output))
        + contiguous_copy_bytes(input_g, suggested_memory_format(input))
        + contiguous_copy_bytes(weight_g, suggested_memory_format(weight))
    )
    # inside the group's backward, its inputs are contiguous in the format thnn_conv_use_channels_last picks for it
    group_format = _thnn_format(input_g.contiguous(memory_format=suggested_memory_format(input)), weight_g)
    inner = contiguous_copy_bytes(
        grad_output_g.contiguous(memory_format=suggested_memory_format(grad_output)), group_format
    )
    columns = _columns_bytes(input_g, weight_g, stride, padding) if mask[1] else 0
    gradients = (
        (_nbytes(input) if mask[0] else 0)
        + (_nbytes(weight) if mask[1] else 0)
        + (grad_output.shape[1] * grad_output.element_size() if mask[2] else 0)
    )
    return held + max(copies + (inner + columns if mask[0] or mask[1] else 0), gradients)
