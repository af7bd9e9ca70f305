"""What the CPU CTC loss kernels hold beside their outputs (memplan.estimator.composite_kernels), which no dispatch
mode sees."""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.composite_kernels import composite_kernel_scratch


def _long_copies(*lengths: Any) -> int:
    """`ctc_loss_tensor` / `ctc_loss_backward_tensor` (aten/src/ATen/native/LossCTC.cpp): `lengths.to(kCPU,
    kLong).contiguous()` of each lengths tensor, held while the op runs: a copy unless it is a contiguous int64 one."""
    return sum(
        0 if tensor.dtype == torch.int64 and tensor.is_contiguous() else tensor.numel() * torch.int64.itemsize
        for tensor in lengths
        if isinstance(tensor, torch.Tensor)
    )


@composite_kernel_scratch(torch.ops.aten._ctc_loss_backward.default, torch.ops.aten._ctc_loss_backward.Tensor)
def ctc_loss_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`ctc_loss_backward_cpu_template` (LossCTC.cpp, torch 2.11-2.14) allocates the gradient (`at::full_like
    (log_probs, neginf)`, its output) and `log_beta = at::empty_like(log_alpha, LEGACY_CONTIGUOUS_MEMORY_FORMAT)`, held
    until it returns: a second log_alpha (measured with torch.profiler). The Tensor-lengths overload first copies its
    lengths to int64. CUDA's backward (LossCTC.cu) is other code: 0 there."""
    if device != "cpu":
        return 0
    names = ("grad", "log_probs", "targets", "input_lengths", "target_lengths", "neg_log_likelihood", "log_alpha")
    bound = dict(zip(names, args, strict=False)) | kwargs
    log_alpha = bound["log_alpha"]
    return log_alpha.numel() * log_alpha.element_size() + _long_copies(bound["input_lengths"], bound["target_lengths"])


@composite_kernel_scratch(torch.ops.aten._ctc_loss.Tensor)
def ctc_loss_tensor_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`ctc_loss_tensor` copies its lengths to int64 (above) before it calls the IntArrayRef overload, whose CPU kernel
    allocates its outputs alone."""
    names = ("log_probs", "targets", "input_lengths", "target_lengths")
    bound = dict(zip(names, args, strict=False)) | kwargs
    return _long_copies(bound["input_lengths"], bound["target_lengths"]) if device == "cpu" else 0
