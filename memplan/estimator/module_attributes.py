"""Tensors a model keeps on its modules as plain attributes, which outlive the step that made them.

A forward that does `self.last_logits = logits.detach()` (for a metrics hook, an attention map to plot, a cache)
keeps that storage alive through the backward and the optimizer step, and into the next iteration until the
attribute is assigned again. No op reads it after its birth, so the graph alone frees it at its last use: a
classifier keeping its 16 MiB of logits was predicted 20.9% low against its real CPU run. After the traced
forward and backward, memplan looks on every module for such attributes (one level into lists, tuples and dicts,
as a frame's locals are read: memplan.estimator.eager_lifetimes) and keeps each storage the step made that one
of them holds to the step's end; after a `--step` function's whole iteration the same (memplan.estimator
.custom_step_trace).

Not counted: the previous iteration's copy, which is alive at the start of the step until the forward assigns
the attribute again (the step is traced once, so there is no previous copy to see); memplan's CPU validator
does not count it either (it counts the storages the measured iteration makes or reads).
"""

from __future__ import annotations

import torch
from torch import nn

# What every nn.Module keeps in its __dict__ itself (parameters, buffers, submodules, hooks): not the user's.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def attribute_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors `model`'s modules hold as attributes of their own, not parameters or buffers."""
    found: list[torch.Tensor] = []
    for module in model.modules():
        for name, value in vars(module).items():
            if name in _MODULE_INTERNALS:
                continue
            items = (
                value if isinstance(value, tuple | list) else value.values() if isinstance(value, dict) else (value,)
            )
            found.extend(
                item for item in items if isinstance(item, torch.Tensor) and not isinstance(item, nn.Parameter)
            )
    return found
