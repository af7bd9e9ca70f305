"""A model's identity for plan files: its parameter names and shapes, which plans depend on."""

from __future__ import annotations

import hashlib
import json

from torch import nn

from memplan.errors import PlanFileError


def model_fingerprint(model: nn.Module) -> str:
    described = [[name, list(param.shape)] for name, param in model.named_parameters(remove_duplicate=False)]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def check_fingerprint(expected: str, made_for: str, model: nn.Module, where: str) -> None:
    """Refuse a plan made for `made_for` (fingerprint `expected`) when `model` is another model."""
    actual = model_fingerprint(model)
    if actual != expected:
        raise PlanFileError(
            f"the plan was made for {made_for} (fingerprint {expected}), but {where} has other modules or "
            f"parameter shapes (fingerprint {actual}); make a plan for it with `memplan plan`"
        )
