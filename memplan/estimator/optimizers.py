"""Build the optimizer the settings name, with the implementation torch would pick on the target."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from memplan.estimator.adam8bit import Adam8bitLayout
from memplan.settings import TrainingSettings

# torch.optim's `_default_to_fused_or_foreach` picks foreach when every parameter is a CUDA tensor
# and the for-loop otherwise (torch/optim/optimizer.py); fused is never the default.
_FOREACH_CAPABLE = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor")


def implementation_kwargs(settings: TrainingSettings) -> dict[str, bool]:
    impl = settings.optimizer_impl
    if settings.optimizer not in _FOREACH_CAPABLE:
        return {}
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach" or (impl == "default" and settings.device == "cuda"):
        return {"foreach": True}
    if impl == "for-loop":
        return {"foreach": False}
    return {}  # CPU default: let torch decide, as it does for the user's real run


def build_optimizer(params: Iterable[torch.nn.Parameter], settings: TrainingSettings) -> Optimizer | None:
    params = list(params)
    name = settings.optimizer
    if name == "none" or not params:
        return None
    kwargs = implementation_kwargs(settings)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, **kwargs)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, **kwargs)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, **kwargs)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, **kwargs)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2, **kwargs)
    if name in ("adam8bit", "paged-adam8bit"):
        return Adam8bitLayout(params, lr=1e-3, paged=name == "paged-adam8bit" and settings.device == "cuda")
    raise AssertionError(f"unknown optimizer {name}")


def optimizer_state_tensors(optimizer: Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
