"""memplan: will this training step fit on my GPU, and what do I change if it won't?

The public names load on first use (PEP 562), after the installed torch is checked against the
releases memplan supports (memplan.compat): `import memplan` alone imports neither torch nor
transformers, so the command line's `--help` and `--version` answer at once, and an unsupported
torch is refused in one line instead of failing somewhere inside an import.
"""

from __future__ import annotations

import importlib
from typing import Any

from memplan.errors import MemplanError as MemplanError
from memplan.version import __version__ as __version__

_EXPORTS = {
    "apply_plan": "memplan.api",
    "compare": "memplan.api",
    "estimate": "memplan.api",
    "plan": "memplan.api",
    "plan_batch": "memplan.api",
    "sweep": "memplan.api",
    "validate": "memplan.api",
    "validate_suite": "memplan.api",
    "which_gpu": "memplan.api",
    "Breakdown": "memplan.estimator.result",
    "EstimateResult": "memplan.estimator.result",
    "read_training_args": "memplan.hf_args",
    "PlanResult": "memplan.planner.plan",
    "CheckpointLayout": "memplan.checkpoint_layout",
    "TrainingSettings": "memplan.settings",
    "format_bytes": "memplan.sizes",
    "parse_size": "memplan.sizes",
    "ValidationResult": "memplan.validate.result",
}

__all__ = sorted([*_EXPORTS, "MemplanError", "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    from memplan.compat import require_supported_torch

    require_supported_torch()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
