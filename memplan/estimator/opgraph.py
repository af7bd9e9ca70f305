"""The recorded step: a list of nodes, one per aten op, input, constant and output.

It keeps what memplan reads of a `torch.fx.Node` (op, target, args, kwargs, meta,
all_input_nodes) and nothing else. fx's own graph names every node, indexes it for queries and
scans its arguments for symbolic values; timed once on the 48-block GPT-2 step of
benchmarks/bench_plan.py, that bookkeeping was about a fifth of a trace, for a graph memplan
never compiles or prints as code.
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
