"""The recorded step: a list of nodes, one per aten op, input, constant and output.

It keeps what memplan reads of a `torch.fx.Node` (op, target, args, kwargs, meta,
all_input_nodes) and nothing else. fx's own graph names every node, indexes it for queries and
scans its arguments for symbolic values; on a 48-block GPT-2 step that bookkeeping was 0.8 s of a
4 s trace (benchmarks/bench_plan.py), for a graph memplan never compiles or prints as code.
"""

from __future__ import annotations

from typing import Any


class OpNode:
    __slots__ = ("op", "target", "args", "kwargs", "meta", "all_input_nodes")

    def __init__(
        self, op: str, target: Any, args: tuple = (), kwargs: dict | None = None, inputs: list[OpNode] | None = None
    ) -> None:
        self.op = op  # "placeholder", "get_attr", "call_function" or "output", as in torch.fx
        self.target = target  # the aten op (call_function) or a name
        self.args = args  # with OpNodes where the op read a recorded tensor
        self.kwargs = kwargs or {}
        self.meta: dict[str, Any] = {}  # "val": the output's fake value (memplan.estimator.recorder)
        self.all_input_nodes = list(dict.fromkeys(inputs)) if inputs else []  # unique, first read first

    def __repr__(self) -> str:
        return f"OpNode({self.op}, {self.target})"


class OpGraph:
    def __init__(self) -> None:
        self.nodes: list[OpNode] = []

    def add(self, node: OpNode) -> OpNode:
        self.nodes.append(node)
        return node


def map_nodes(value: Any, fn: Any) -> Any:
    """`value` (args or kwargs) with every OpNode in it replaced by `fn(node)`."""
    if isinstance(value, OpNode):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(map_nodes(item, fn) for item in value)
    if isinstance(value, dict):
        return {key: map_nodes(item, fn) for key, item in value.items()}
    return value
