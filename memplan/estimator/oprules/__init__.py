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

OutputBytesRule = Callable[[tuple[Any, ...], dict[str, Any], str], list[int]]

OUTPUT_BYTES_RULES: dict[Any, OutputBytesRule] = {}


def output_bytes_rule(*ops: Any) -> Callable[[OutputBytesRule], OutputBytesRule]:
    def register(rule: OutputBytesRule) -> OutputBytesRule:
        for op in ops:
            OUTPUT_BYTES_RULES[op] = rule
        return rule

    return register


def _load_families() -> None:
    from memplan.estimator.oprules import col2im, losses, norms, rnn  # noqa: F401  (registers their rules)


_load_families()
