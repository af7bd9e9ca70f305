"""Per-op knowledge the fake tensors lack: output sizes that fake kernels get wrong.

Each rule is keyed by aten op and returns the true storage bytes of each tensor output, in order,
as a pure function of the op's argument shapes and dtypes and the target device ("cpu" or "cuda":
memplan's fake tensors are CPU tensors for both targets, so a fake kernel answers as the CPU would).
Ops known to produce placeholder outputs under fake tensors and without a rule are reported as
unsupported, never counted as zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

Rule = TypeVar("Rule", bound=Callable[..., Any])


def _registrar(table: dict[Any, Rule]) -> Callable[..., Callable[[Rule], Rule]]:
    """A decorator factory filling `table`: `@registrar(op, ...)` keys the rule by each op."""

    def rule_for(*ops: Any) -> Callable[[Rule], Rule]:
        def register(rule: Rule) -> Rule:
            for op in ops:
                table[op] = rule
            return rule

        return register

    return rule_for


OutputBytesRule = Callable[[tuple[Any, ...], dict[str, Any], str], list[int]]

OUTPUT_BYTES_RULES: dict[Any, OutputBytesRule] = {}


output_bytes_rule = _registrar(OUTPUT_BYTES_RULES)


# The dtype of each output where the real kernel's differs from the fake kernel's (None: the fake kernel's is right):
# the recorder gives the op's outputs those dtypes (real_kernel_outputs), so that autograd and later ops see what the
# real run sees (a gradient of the input's dtype needs no cast back to it).
OutputDtypesRule = Callable[[tuple[Any, ...], dict[str, Any], str], tuple[Any, ...]]

OUTPUT_DTYPE_RULES: dict[Any, OutputDtypesRule] = {}


output_dtypes_rule = _registrar(OUTPUT_DTYPE_RULES)


# The outputs (by position) the real kernel makes contiguous where the fake kernel copies another tensor's layout:
# filled in by the families' modules, each with its source.
CONTIGUOUS_OUTPUTS: dict[Any, frozenset[int]] = {}


# The memory format of each output (None: the fake kernel's layout is right) where the real kernel lays it out in a
# format of its own choosing (`at::empty_like(input, input.suggest_memory_format())`) and torch's fake kernel keeps
# another tensor's strides: filled in by the families' modules, each with its source.
OutputFormatsRule = Callable[[tuple[Any, ...], dict[str, Any], str], tuple[torch.memory_format | None, ...]]

OUTPUT_FORMAT_RULES: dict[Any, OutputFormatsRule] = {}


output_formats_rule = _registrar(OUTPUT_FORMAT_RULES)


def real_kernel_outputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, device: str) -> Any:
    """`out` with each output a rule gives another dtype, or that the real kernel makes contiguous or lays out in
    another memory format, replaced by an empty tensor of that dtype and layout (made by the modes below the
    caller's: a fake tensor, recorded by no one)."""
    rule, contiguous = OUTPUT_DTYPE_RULES.get(func), CONTIGUOUS_OUTPUTS.get(func, frozenset())
    format_rule = OUTPUT_FORMAT_RULES.get(func)
    if rule is None and not contiguous and format_rule is None:
        return out
    outputs = list(out) if isinstance(out, tuple) else [out]
    dtypes = rule(args, kwargs, device) if rule is not None else (None,) * len(outputs)
    formats = format_rule(args, kwargs, device) if format_rule is not None else (None,) * len(outputs)
    for index, (tensor, dtype, memory_format) in enumerate(zip(outputs, dtypes, formats, strict=False)):
        if not isinstance(tensor, torch.Tensor):
            continue
        if index in contiguous and not _laid_out_in(tensor, torch.contiguous_format):
            outputs[index] = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=tensor.device)
        elif memory_format is not None and not _laid_out_in(tensor, memory_format):
            outputs[index] = torch.empty(
                tensor.shape, dtype=dtype or tensor.dtype, device=tensor.device, memory_format=memory_format
            )
        elif dtype is not None and tensor.dtype != dtype:
            outputs[index] = torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device=tensor.device)
    return tuple(outputs) if isinstance(out, tuple) else outputs[0]


def _laid_out_in(tensor: torch.Tensor, memory_format: torch.memory_format) -> bool:
    """Whether `tensor` has the strides the real kernel's `at::empty_like(input, memory_format)` gives its output:
    exactly a fresh tensor's in that format. `is_contiguous(memory_format)` skips the strides of size-1 dimensions,
    so a [N, C, 1, 1] tensor with channels-last strides, (C, 1, C, C), passes as contiguous, where the real
    kernel's is (C, 1, 1, 1); the next op that reads the format from the strides' order (`suggest_memory_format`:
    upsample_bilinear2d, the CPU convolutions) took the fake one as channels-last and laid out every tensor after it
    so (a UperNet head's pyramid pooling, BatchNorm2d over its 1x1 pooled map: channels-last through the whole FPN
    where the real run is contiguous, a weight gradient copied to the parameter's layout on each convolution)."""
    if tensor.dim() not in (4, 5) and memory_format != torch.contiguous_format:
        return tensor.is_contiguous(memory_format=memory_format)
    fresh = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta", memory_format=memory_format)
    return tensor.stride() == fresh.stride()


# The output of each op whose fake kernel refuses arguments the real kernel runs, or lays its output out otherwise:
# (sizes, strides, dtype) as a pure function of the op's arguments; for an op whose schema returns several tensors, a
# tuple of them, one an output in order. The fake mode makes empty tensors so and skips the fake kernel
# (memplan.estimator.fake_mode); each rule checks what the real kernel checks.
OutputLayout = tuple[list[int], list[int], torch.dtype]
FakeKernelRule = Callable[[tuple[Any, ...], dict[str, Any]], OutputLayout | tuple[OutputLayout, ...]]

FAKE_KERNEL_RULES: dict[Any, FakeKernelRule] = {}


fake_kernel_rule = _registrar(FAKE_KERNEL_RULES)


def _load_families() -> None:
    from memplan.estimator.oprules import (  # noqa: F401  (registers their rules)
        col2im,
        ctc,
        grouped_mm,
        losses,
        masked,
        norms,
        rnn,
    )


_load_families()
