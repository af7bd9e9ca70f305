"""How the autograd engine sums the gradients of a tensor used twice, with and without a dispatch
mode (docs/validation.md, "Gradient accumulation in place"). The truth is torch's own behaviour:
a plain backward accumulates into the first gradient's storage (InputBuffer::accumulate,
can_accumulate_inplace); under any Python dispatch mode, which memplan's trace and its CPU counter
both run under, it adds out of place. If torch changes either, the docs' statement must change.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _used_twice() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(1000, requires_grad=True)
    hidden = x * 2
    first, second = torch.tanh(hidden) * hidden, hidden * hidden
    return hidden, first, second


def test_a_plain_backward_accumulates_in_the_first_gradients_storage() -> None:
    hidden, first, second = _used_twice()
    branch_grads: list[int] = []
    accumulated: list[int] = []
    # Each product's gradient for `hidden` (its first input), and what `hidden`'s node then receives.
    second.grad_fn.register_hook(lambda grad_inputs, _: branch_grads.append(grad_inputs[0].data_ptr()))
    hidden.grad_fn.register_prehook(lambda grad_outputs: accumulated.append(grad_outputs[0].data_ptr()))
    (first + second).sum().backward()
    assert accumulated and accumulated[0] in branch_grads  # no new storage: added in place


def test_under_a_dispatch_mode_the_engine_adds_out_of_place() -> None:
    hidden, first, second = _used_twice()
    names = _Names()
    with names:
        (first + second).sum().backward()
    assert "aten.add.Tensor" in names.names and "aten.add_.Tensor" not in names.names
