"""FLOPs of graph nodes from torch.utils.flop_counter's per-op formulas, on the traced fake values."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from memplan.estimator.leaves import map_leaves
from memplan.estimator.opgraph import OpNode

aten = torch.ops.aten


def _shape(value: torch.Tensor | torch.Size) -> torch.Size:
    return value.shape if isinstance(value, torch.Tensor) else value


def _sdpa_for_cpu_flops(query, key, value, *args, out_val=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    # flop_counter has no formula for the CPU flash kernel (design.md §3: attention FLOPs would
    # silently vanish); it computes what the CUDA flash kernel does.
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


EXTRA_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_for_cpu_flops}

# Attention kernels whose (query, key, value) are (batch, heads, seq, head_dim), by the position of
# the query among their arguments (backward kernels take grad_out first). With grouped-query
# attention key and value have fewer heads; each is read once per query head of its group, which
# is what flop_counter's formulas count from torch 2.13 on. Before that (2.10-2.12) they assert
# that the head counts are equal, so memplan hands them key and value shapes broadcast to the
# query's heads: the same count on every release.
SDPA_QUERY_POSITION = {
    aten._scaled_dot_product_flash_attention: 0,
    aten._scaled_dot_product_efficient_attention: 0,
    aten._scaled_dot_product_cudnn_attention: 0,
    aten._scaled_dot_product_flash_attention_for_cpu: 0,
    aten._scaled_dot_product_flash_attention_backward: 1,
    aten._scaled_dot_product_efficient_attention_backward: 1,
    aten._scaled_dot_product_cudnn_attention_backward: 1,
}


def broadcast_kv_heads(args: tuple, query_position: int) -> tuple:
    """`args` with key and value (after the query) replaced by their shapes at the query's head count."""
    query = args[query_position]
    shapes = list(args)
    for position in (query_position + 1, query_position + 2):
        batch, _, seq, head_dim = args[position].shape
        shapes[position] = torch.Size((batch, query.shape[1], seq, head_dim))
    return tuple(shapes)


def node_flops(node: OpNode) -> int:
    """FLOPs of one call_function node (0 for ops flop_counter counts as free: pointwise, views)."""
    if node.op != "call_function":
        return 0
    packet = getattr(node.target, "overloadpacket", None)
    formula = EXTRA_FORMULAS.get(packet) or flop_registry.get(packet)
    if formula is None:
        return 0
    args, kwargs = _values(node)
    if packet in SDPA_QUERY_POSITION:
        # flop_counter's formulas read `.shape` of tensors and take torch.Size as it is.
        args = broadcast_kv_heads(args, SDPA_QUERY_POSITION[packet])
    return int(formula(*args, out_val=node.meta.get("val"), **kwargs))


def _values(node: OpNode) -> tuple[tuple, dict]:
    def value_of(arg: object) -> object:
        return arg.meta.get("val") if isinstance(arg, OpNode) else arg

    return tuple(map_leaves(node.args, OpNode, value_of)), dict(map_leaves(node.kwargs, OpNode, value_of))
