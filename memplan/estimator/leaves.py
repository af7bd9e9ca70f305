"""The leaves of nested tuples, lists and dicts: op arguments, outputs, batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def tensors_in(value: object) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def map_leaves(value: Any, leaf_type: type | tuple[type, ...], fn: Callable[[Any], Any]) -> Any:
    """`value` with every leaf of `leaf_type` replaced by `fn(leaf)`, containers rebuilt as they were.

    A plain recursion rather than torch's pytree.tree_map_only: it runs for every recorded op.
    """
    if isinstance(value, leaf_type):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(map_leaves(item, leaf_type, fn) for item in value)
    if isinstance(value, dict):
        return {key: map_leaves(item, leaf_type, fn) for key, item in value.items()}
    return value
