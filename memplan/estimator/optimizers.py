"""Build the optimizer the settings name, with the implementation torch would pick on the target."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
    # Under offload the step runs on host tensors (memplan.distributed.offload, .deepspeed): torch's own pick.
    if impl == "foreach" or (impl == "default" and settings.device == "cuda" and not settings.offloads_to_host):
        return {"foreach": True}
    if impl == "for-loop":
        return {"foreach": False}
    return {}  # CPU default: let torch decide, as it does for the user's real run


def optimizer_recipe(settings: TrainingSettings) -> tuple[type[Optimizer], dict[str, Any]]:
    """The optimizer's class and its arguments (besides the parameters)."""
    name = settings.optimizer
    kwargs = implementation_kwargs(settings)
    if name == "adamw":
        return torch.optim.AdamW, {"lr": 1e-3, **kwargs}
    if name == "adam":
        return torch.optim.Adam, {"lr": 1e-3, **kwargs}
    if name == "sgd":
        return torch.optim.SGD, {"lr": 1e-2, **kwargs}
    if name == "sgd-momentum":
        return torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, **kwargs}
    if name == "adafactor":
        return torch.optim.Adafactor, {"lr": 1e-2, **kwargs}
    if name in ("adam8bit", "paged-adam8bit"):
        return Adam8bitLayout, {"lr": 1e-3, "paged": name == "paged-adam8bit" and settings.device == "cuda"}
    raise AssertionError(f"unknown optimizer {name}")


def build_optimizer(params: Iterable[torch.nn.Parameter], settings: TrainingSettings) -> Optimizer | None:
    """The settings' optimizer over `params`; under --parallel zero1, torch's ZeroRedundancyOptimizer
    around it (memplan.distributed.zero), which builds it over rank 0's share."""
    params = list(params)
    if settings.optimizer == "none" or not params:
        return None
    optimizer_class, arguments = optimizer_recipe(settings)
    if settings.parallel == "zero1" and settings.deepspeed_stage is None:  # (DeepSpeed's stage 1 shards it itself)
        from memplan.distributed.zero import ShardedOptimizerRank

        return ShardedOptimizerRank(params, optimizer_class, settings.world_size, **arguments)
    return optimizer_class(params, **arguments)


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer that holds this rank's state and updates its parameters: under --parallel zero1
    the one ZeroRedundancyOptimizer built over the rank's share (its own `state` stays empty), else
    the optimizer itself."""
    return getattr(optimizer, "local_optimizer", optimizer)


def optimizer_state_tensors(optimizer: Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    holder = local_optimizer(optimizer)
    return [value for state in holder.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
