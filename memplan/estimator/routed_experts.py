"""Mixture-of-experts layers whose tensors are sized by the routing, which a trace over fake tensors cannot know.

transformers 5 runs an experts module (`@use_experts_implementation`, transformers/integrations/moe.py) by the
config's `experts_implementation`: "grouped_mm" (its default) and "batched_mm" size every tensor by tokens × top-k,
whatever the routing, and trace exactly; "eager" (the modeling file's own forward, e.g. modeling_mixtral.py
`MixtralExperts.forward`) loops over the experts the batch hit (`expert_mask.sum(...).nonzero()`) and gathers each
one's tokens (`torch.where(expert_mask[expert_idx])`), so how many tensors it makes, and their sizes, follow the
routing. Measured on a real CPU step of a tiny Mixtral (batch 8 × 128 tokens), eager's peak was 4.5 % above
grouped_mm's, so grouped_mm's prediction does not bound it.
"""

from __future__ import annotations

import os
from types import TracebackType

from torch import nn

# use_experts_implementation replaces the class's forward by its own, defined in this file, which picks the
# implementation by the config's `_experts_implementation` at each call.
_DECORATOR_FILE = os.path.join("transformers", "integrations", "moe.py")
_SIZED_BY_ROUTING = "eager"
_ROUTING_FREE = ("grouped_mm", "batched_mm")


def experts_sized_by_routing(module: object) -> bool:
    """Whether `module` is a transformers experts module run by its "eager" implementation (a decorated class, whose
    choice the config's `experts_implementation` makes), rather than a shape-only one."""
    if not isinstance(module, nn.Module):
        return False
    forward = getattr(type(module).forward, "__code__", None)
    if forward is None or not forward.co_filename.endswith(_DECORATOR_FILE):
        return False  # a forward of the class's own, not use_experts_implementation's: no other one to pick
    config = getattr(module, "config", None)
    return getattr(config, "_experts_implementation", None) == _SIZED_BY_ROUTING


def routing_sized_experts_in(trace: TracebackType | None) -> bool:
    """Whether a frame of `trace` (a value-dependent error's) ran the forward of such an experts module."""
    while trace is not None:
        if experts_sized_by_routing(trace.tb_frame.f_locals.get("self")):
            return True
        trace = trace.tb_next
    return False


def eager_experts_message() -> str:
    shape_only = " or ".join(f'"{name}"' for name in _ROUTING_FREE)
    return (
        "transformers' \"eager\" experts implementation (the config's experts_implementation) loops over the "
        "experts the batch routes tokens to, so its tensors' number and sizes follow the routing, which tensors "
        f"without values do not have; memplan traces {shape_only} (transformers' default is grouped_mm), whose "
        "memory does not depend on the routing: set experts_implementation to one of them in the model's "
        'config.json (their peak differs from "eager"\'s, which memplan does not predict)'
    )
