"""Per-op knowledge the fake tensors lack: output sizes that fake kernels get wrong.

Each rule is keyed by aten op and returns the true storage bytes of each tensor output, in order,
as a pure function of the op's argument shapes and dtypes and the target device ("cpu" or "cuda":
memplan's fake tensors are CPU tensors for both targets, so a fake kernel answers as the CPU would).
Ops known to produce placeholder outputs under fake tensors and without a rule are reported as
unsupported, never counted as zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

OutputBytesRule = Callable[[tuple[Any, ...], dict[str, Any], str], list[int]]

OUTPUT_BYTES_RULES: dict[Any, OutputBytesRule] = {}


def output_bytes_rule(*ops: Any) -> Callable[[OutputBytesRule], OutputBytesRule]:
    def register(rule: OutputBytesRule) -> OutputBytesRule:
        for op in ops:
            OUTPUT_BYTES_RULES[op] = rule
        return rule

    return register


# The dtype of each output where the real kernel's differs from the fake kernel's (None: the fake kernel's is right):
# the recorder gives the op's outputs those dtypes (real_kernel_outputs), so that autograd and later ops see what the
# real run sees (a gradient of the input's dtype needs no cast back to it).
OutputDtypesRule = Callable[[tuple[Any, ...], dict[str, Any], str], tuple[Any, ...]]

OUTPUT_DTYPE_RULES: dict[Any, OutputDtypesRule] = {}


def output_dtypes_rule(*ops: Any) -> Callable[[OutputDtypesRule], OutputDtypesRule]:
    def register(rule: OutputDtypesRule) -> OutputDtypesRule:
        for op in ops:
            OUTPUT_DTYPE_RULES[op] = rule
        return rule

    return register


# The outputs (by position) the real kernel makes contiguous where the fake kernel copies another tensor's layout:
# filled in by the families' modules, each with its source.
CONTIGUOUS_OUTPUTS: dict[Any, frozenset[int]] = {}


def real_kernel_outputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, device: str) -> Any:
    """`out` with each output a rule gives another dtype, or that the real kernel makes contiguous, replaced by an
    empty tensor of that dtype and layout (made by the modes below the caller's: a fake tensor, recorded by no
    one)."""
    rule, contiguous = OUTPUT_DTYPE_RULES.get(func), CONTIGUOUS_OUTPUTS.get(func, frozenset())
    if rule is None and not contiguous:
        return out
    outputs = list(out) if isinstance(out, tuple) else [out]
    dtypes = rule(args, kwargs, device) if rule is not None else (None,) * len(outputs)
    for index, (tensor, dtype) in enumerate(zip(outputs, dtypes, strict=False)):
        if not isinstance(tensor, torch.Tensor):
            continue
        if index in contiguous and not tensor.is_contiguous():
            outputs[index] = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=tensor.device)
        elif dtype is not None and tensor.dtype != dtype:
            outputs[index] = torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device=tensor.device)
    return tuple(outputs) if isinstance(out, tuple) else outputs[0]


def _load_families() -> None:
    from memplan.estimator.oprules import col2im, losses, norms, rnn  # noqa: F401  (registers their rules)


_load_families()
