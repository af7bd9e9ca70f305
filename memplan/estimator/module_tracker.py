"""Which module is running as a trace records its ops: what names the module a peak falls in."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


class ModuleTracker:
    """Records which module is running as graph nodes are added, to name where the peak falls."""

    def __init__(self, model: nn.Module, node_count: Callable[[], int]) -> None:
        self.names = {id(module): name or type(model).__name__ for name, module in model.named_modules()}
        self.stack: list[str] = []
        self.transitions: list[tuple[int, str | None]] = [(0, None)]
        self.handles: list = []
        self._node_count = node_count

    def _pre(self, module: nn.Module, args: object) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)
            self.transitions.append((self._node_count(), name))

    def _post(self, module: nn.Module, args: object, output: object) -> None:
        if self.names.get(id(module)) is not None and self.stack:
            self.stack.pop()
            self.transitions.append((self._node_count(), self.stack[-1] if self.stack else None))

    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> ModuleTracker:
        self.handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post),  # not on error: keep the failing module
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def per_node(self, node_count: int) -> list[str | None]:
        result: list[str | None] = [None] * node_count
        for (start, name), (end, _) in zip(self.transitions, self.transitions[1:] + [(node_count, None)], strict=True):
            for index in range(start, min(end, node_count)):
                result[index] = name
        return result
