"""FLOPs of graph nodes from torch.utils.flop_counter's per-op formulas, on the traced fake values."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from memplan.estimator.leaves import map_leaves
from memplan.estimator.opgraph import OpNode

aten = torch.ops.aten


def _sdpa_for_cpu_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    # flop_counter has no formula for the CPU flash kernel (design.md §3: attention FLOPs would
    # silently vanish); it computes what the CUDA flash kernel does.
    return sdpa_flop_count(query.shape, key.shape, value.shape)


EXTRA_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_for_cpu_flops}


def node_flops(node: OpNode) -> int:
    """FLOPs of one call_function node (0 for ops flop_counter counts as free: pointwise, views)."""
    if node.op != "call_function":
        return 0
    packet = getattr(node.target, "overloadpacket", None)
    if packet in EXTRA_FORMULAS:
        args, kwargs = _values(node)
        return int(EXTRA_FORMULAS[packet](*args, **kwargs))
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    args, kwargs = _values(node)
    return int(formula(*args, out_val=node.meta.get("val"), **kwargs))


def _values(node: OpNode) -> tuple[tuple, dict]:
    def value_of(arg: object) -> object:
        return arg.meta.get("val") if isinstance(arg, OpNode) else arg

    return tuple(map_leaves(node.args, OpNode, value_of)), dict(map_leaves(node.kwargs, OpNode, value_of))
