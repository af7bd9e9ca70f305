"""`_ctc_loss` (what `F.ctc_loss` runs where cuDNN's is not taken): its two outputs as the real kernel lays them out.

aten/src/ATen/native/LossCTC.cpp (torch 2.11-2.14), `ctc_loss_allocate_outputs`, shared by the CPU kernel and the
C++ meta kernel `ctc_loss_meta`: `neg_log_likelihood = at::empty({batch_size})` and `log_alpha = at::empty({batch_size,
log_probs.size(0), 2*max_target_length+1})` in log_probs' dtype, after checking the targets' dtype (int64, or int32),
a 3-D log_probs, 1-D or 2-D targets, the blank in the label range, one input and one target length per sample,
lengths at least 0, input lengths at most log_probs.size(0), and 1-D targets as long as the target lengths' sum (2-D:
one row per sample, at least max(target_lengths) wide). Both overloads carry the `dynamic_output_shape` tag, so a fake
tensor mode refuses them (DynamicOutputShapeException: memplan had called the op data-dependent even with Python int
lengths): log_alpha's size is a function of the lengths, which the IntArrayRef overload has as arguments.

The Tensor-lengths overload (`ctc_loss_tensor`) reads the lengths' values (`.to(kCPU, kLong)`) and calls the other:
memplan has those values only for lengths made from Python numbers in the traced code (a fake tensor's `constant`);
lengths computed from the batch are refused with a message saying so.

`_ctc_loss_backward` has no fake kernel: FakeTensorMode ran the real CPU kernel over zero-filled tensors for it
(`run_fallback_kernel`), the whole CTC recursion at the traced batch: 22 s of a 37 s largest-batch search on an H100
for a tiny wav2vec2, whose search tries batches of thousands. Its output is `ctc_loss_backward_cpu_template`'s and
`ctc_loss_backward_gpu_template`'s (LossCTC.cpp, cuda/LossCTC.cu) `grad = at::full_like(log_probs, neginf,
LEGACY_CONTIGUOUS_MEMORY_FORMAT)`: log_probs' sizes and dtype, contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from memplan.estimator.oprules import OutputLayout, fake_kernel_rule


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _contiguous(sizes: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return list(reversed(strides))


def ctc_loss_outputs(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: Sequence[int],
    target_lengths: Sequence[int],
    blank: int,
) -> tuple[OutputLayout, OutputLayout]:
    """`ctc_loss_allocate_outputs`' checks and outputs (module docstring); AT_DISPATCH_FLOATING_TYPES first."""
    _check(log_probs.dtype in (torch.float32, torch.float64), f'"ctc_loss_cpu" not implemented for {log_probs.dtype}')
    expected = torch.int64 if targets.dtype == torch.int64 else torch.int32
    _check(targets.dtype == expected, f"ctc_loss: expected targets to have scalar type {expected}, got {targets.dtype}")
    _check(log_probs.dim() == 3, f"ctc_loss: expected a 3-D log_probs, got {log_probs.dim()}-D")
    _check(targets.dim() in (1, 2), f"ctc_loss: expected 1-D or 2-D targets, got {targets.dim()}-D")
    batch_size, num_labels = log_probs.size(1), log_probs.size(2)
    _check(0 <= blank < num_labels, "blank must be in label range")
    _check(len(input_lengths) == batch_size, "input_lengths must be of size batch_size")
    _check(len(target_lengths) == batch_size, "target_lengths must be of size batch_size")
    _check(all(length >= 0 for length in target_lengths), "Expected target_lengths to have value at least 0")
    max_target_length = max(target_lengths, default=0)
    if targets.dim() == 1:
        _check(targets.size(0) == sum(target_lengths), "ctc_loss: targets' size must be the target lengths' sum")
    else:
        _check(targets.size(0) == batch_size, "ctc_loss: targets must have one row per sample")
        _check(targets.size(1) >= max_target_length, f"Expected targets to have size at least {max_target_length}")
    max_input_length = log_probs.size(0)
    _check(
        all(0 <= length <= max_input_length for length in input_lengths),
        f"Expected input_lengths to have values from 0 to {max_input_length}",
    )
    alpha = [batch_size, max_input_length, 2 * max_target_length + 1]
    return ([batch_size], [1], log_probs.dtype), (alpha, _contiguous(alpha), log_probs.dtype)


def _bound(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "zero_infinity")
    defaults = {"blank": 0, "zero_infinity": False}
    return [args[i] if i < len(args) else kwargs.get(name, defaults.get(name)) for i, name in enumerate(names)]


@fake_kernel_rule(torch.ops.aten._ctc_loss.default)
def ctc_loss(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[OutputLayout, OutputLayout]:
    log_probs, targets, input_lengths, target_lengths, blank, _ = _bound(args, kwargs)
    return ctc_loss_outputs(
        log_probs, targets, [int(n) for n in input_lengths], [int(n) for n in target_lengths], blank
    )


def known_lengths(lengths: torch.Tensor, name: str) -> list[int]:
    """The values of a lengths tensor where memplan has them: a real tensor's, or a fake one's made from Python
    numbers in the traced code (its `constant`); otherwise a clear refusal."""
    _check(
        not lengths.is_floating_point() and not lengths.is_complex() and lengths.dtype != torch.bool,
        f"{name} must be integral",
    )
    constant = getattr(lengths, "constant", None)
    if constant is not None:
        return [int(n) for n in constant.reshape(-1).tolist()]
    if not isinstance(lengths, torch._subclasses.fake_tensor.FakeTensor):
        return [int(n) for n in lengths.reshape(-1).tolist()]
    raise RuntimeError(
        f"ctc_loss with {name} as a tensor computed from the batch: log_alpha, which the kernel allocates, is "
        "[batch, input length, 2 * max(target_lengths) + 1], and memplan has no tensor values while it traces; pass "
        "the lengths as Python lists of ints, at the sizes the real batches have"
    )


@fake_kernel_rule(torch.ops.aten._ctc_loss.Tensor)
def ctc_loss_tensor_lengths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[OutputLayout, OutputLayout]:
    log_probs, targets, input_lengths, target_lengths, blank, _ = _bound(args, kwargs)
    inputs = known_lengths(input_lengths, "input_lengths")
    return ctc_loss_outputs(log_probs, targets, inputs, known_lengths(target_lengths, "target_lengths"), blank)


@fake_kernel_rule(torch.ops.aten._ctc_loss_backward.default, torch.ops.aten._ctc_loss_backward.Tensor)
def ctc_loss_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OutputLayout:
    log_probs = args[1] if len(args) > 1 else kwargs["log_probs"]
    sizes = list(log_probs.shape)
    return sizes, _contiguous(sizes), log_probs.dtype
