"""Activation checkpointing as Hugging Face's gradient checkpointing applies it: every repeated block."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def repeated_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Outermost `nn.ModuleList`s holding at least two blocks, all of the same class."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(block) for block in module}) != 1:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue  # already inside a checkpointed block
        found.append((name, module))
    return found


def checkpoint_module(module: nn.Module) -> None:
    """Non-reentrant checkpointing of one module's forward (kwargs pass through)."""
    forward = module.forward
    module.forward = functools.partial(checkpoint, forward, use_reentrant=False)  # type: ignore[method-assign]


def apply_checkpoint_all(model: nn.Module) -> list[str]:
    """Checkpoint every block of every repeated-block list; returns the qualified block names."""
    names = []
    for list_name, blocks in repeated_block_lists(model):
        for index, block in enumerate(blocks):
            checkpoint_module(block)
            names.append(f"{list_name}.{index}" if list_name else str(index))
    return names
