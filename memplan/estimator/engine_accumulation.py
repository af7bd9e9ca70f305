"""The autograd engine's sum of a tensor's gradients, in place where a plain run adds in place.

Where a tensor feeds several ops, the engine sums their gradients in the input buffer of the tensor's Node as each
arrives (torch/csrc/autograd/input_buffer.cpp, torch 2.11-2.14, `accumulate`):

    } else if (can_accumulate_inplace(old_var) && !at::isTensorSubclassLike(var)) {
      buffer[pos] = old_var.add_(var);
    } else {
      buffer[pos] = old_var + var;
    }

with `can_accumulate_inplace(v)`: `!(at::isTensorSubclassLike(v) || v._is_zerotensor() || v.is_nested()) &&
v.is_non_overlapping_and_dense() && at::caching::adjusted_use_count(v) == 1 && v.has_storage() &&
v.storage().use_count() == 1` (after `if (at::GradMode::is_enabled()) buffer[pos] = old_var + var;`). `old_var` is
the sum so far (the first gradient to arrive, then what the adds made), `var` the producer's output being moved in.
The engine calls it from `InputBuffer::add` in `Engine::evaluate_function`, after the producer's formula, its
`validate_outputs` and its post-hooks, on the thread running the backward, with the producer as the current Node
(`NodeGuard` in `thread_main`): `torch._C._current_autograd_node()` is the producer.

A fake tensor, and any tensor while a Python dispatch mode is active, is `isTensorSubclassLike`, so memplan's trace
and its CPU counter (both dispatch modes) always saw the out-of-place add: one gradient-sized buffer more than a
plain run while it adds. Here the add is run as the plain engine would, in place, where every condition holds:

- the add is the engine's: the current Node's formula has returned (its post-hook ran) and `var` is one of its
  outputs, grad mode is off, no `alpha`, both dense strided tensors of one shape and dtype;
- `old_var` is non-overlapping and dense;
- the reference counts: the engine's buffer holds the only reference to `old_var`'s TensorImpl and that TensorImpl
  the only one to its storage. A dispatch mode sees the counts through the dispatcher's own references (the boxed
  arguments, the Python object), the same for every op: `_baseline()` reads them once on a plain backward where the
  engine adds in place, and an add is run in place only where `old_var`'s counts equal them (and `var`'s are not
  below them, which would say they are read differently here). A formula that returns one tensor to two inputs
  (AddBackward0's `self` and `other`) puts it in two buffers, and a gradient that is a view (ViewBackward0's
  reshape) keeps its base alive in its autograd metadata: one more reference to the TensorImpl or the storage, so
  the add stays out of place, as in the plain run (tests/test_accumulation_in_place.py). Holders memplan itself
  adds to a storage (the graph recorder's aliases of each op's output) are told by `storage_holders` and left out
  of the count. The counts are read by the top dispatch mode: a mode above it passes each op on with its arguments
  boxed again, one more reference to each, and every sum would stay out of place (memplan's OptimizerLocals is on
  the stack only inside an optimizer's step for that: a backward run there, an LBFGS closure's, still adds out of
  place).

Anything else (a count memplan cannot explain, a subclass, a sparse or zero tensor) keeps the out-of-place add:
over-predicting by the buffer, never under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
_ADD = aten.add.Tensor
_ADD_ = aten.add_.Tensor


def _counts(tensor: torch.Tensor) -> tuple[int, int]:
    """References to the tensor's TensorImpl and to its storage, as a dispatch mode reads them."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class _Probe(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, int], tuple[int, int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _ADD and torch._C._current_autograd_node() is not None and not torch.is_grad_enabled():
            self.seen.append((_counts(args[0]), _counts(args[1])))
        return func(*args, **(kwargs or {}))


_BASELINE: list[tuple[int, int]] = []  # once read


def _baseline() -> tuple[int, int] | None:
    """The counts a dispatch mode reads on a buffered gradient the plain engine adds into in place (the engine's
    reference alone), or None where they cannot be read so (an add in place is then never assumed). Read on a
    backward of real tensors: call it first outside any dispatch (`EngineAccumulation()` does), where autograd
    records the probe's graph."""
    if _BASELINE:
        return _BASELINE[0]
    if not hasattr(torch.Tensor, "_use_count") or not hasattr(torch._C, "_storage_Use_Count"):
        return None  # a release that cannot tell: every sum stays out of place
    with _disable_current_modes(), torch.enable_grad():
        leaf = torch.ones(4, requires_grad=True)
        hidden = leaf * 2  # two ops read it: its Node sums two fresh gradients
        loss = (hidden.sin() * hidden.cos()).sum()
        if loss.grad_fn is None:  # called inside a dispatch, below autograd
            return None
        probe = _Probe()
        with probe:
            torch.autograd.grad(loss, leaf)
    if len(probe.seen) != 1 or probe.seen[0][0] != probe.seen[0][1]:
        return None
    _BASELINE.append(probe.seen[0][0])
    return _BASELINE[0]


def _non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """c10's `compute_non_overlapping_and_dense`: some order of its dimensions (of more than one element) is
    contiguous."""
    expected = 1
    dimensions = zip(tensor.shape, tensor.stride(), strict=True)
    for stride, size in sorted((stride, size) for size, stride in dimensions if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _plain(tensor: object) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and type(tensor) in (torch.Tensor, FakeTensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not tensor._is_zerotensor()
    )


def graph_nodes(roots: list[Any]) -> list[tuple[Any, tuple[tuple[Any, int], ...]]]:
    """Every autograd Node reachable from `roots`, once, with its `next_functions`, in the order a depth-first walk
    meets them. The list keeps each Node's Python wrapper alive: a C++ Node's wrapper is made anew for each
    `next_functions` read and freed with it, and on torch 2.10-2.12 a freed wrapper's id was soon another Node's,
    which a walk keyed by id() then skipped (checkpointed predictions 2-3.5% high)."""
    seen: dict[int, tuple[Any, tuple[tuple[Any, int], ...]]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        next_functions = tuple(node.next_functions)
        seen[id(node)] = (node, next_functions)
        stack.extend(next_node for next_node, _ in next_functions)
    return list(seen.values())


class EngineAccumulation:
    """Tells, at each op, whether it is the engine's sum of two gradients that a plain run makes in place.

    The Nodes that may feed a sum get a post-hook before the backward runs (`roots_hooked`, around the step);
    `op_for(func, args, kwargs)`, called before running each op, gives the op to run. `storage_holders(tensor)`:
    references to the tensor's storage that memplan adds and a plain run has not."""

    def __init__(self, storage_holders: Callable[[torch.Tensor], int] | None = None) -> None:
        self._storage_holders = storage_holders
        _baseline()  # read now, outside any dispatch
        self._node: Any = None  # the Node whose formula returned last, while the engine adds its outputs
        self._outputs: frozenset[int] = frozenset()  # its outputs' TensorImpls (Tensor._cdata)

    def hook(self, node: Any) -> None:
        node.register_hook(self.formula_returned)

    def hook_graph(self, roots: list[Any], running: Any = None) -> None:
        """Post-hooks on the Nodes reachable from `roots` (but `running`, whose formula runs already) that send a
        gradient to an input that more than one gradient reaches: only their outputs are ever added to another.
        Other Nodes get none (a post-hook makes the engine keep a Node's incoming gradients until the hooks ran)."""
        fan_in: dict[tuple[int, int], int] = {}  # (id of a Node, input) -> edges into it
        edges_of: list[tuple[Any, list[tuple[Any, int]]]] = []
        for node, next_functions in graph_nodes(roots):  # every wrapper alive until the walk ends: no id reused
            edges = [(next_node, number) for next_node, number in next_functions if next_node is not None]
            for next_node, number in edges:
                key = (id(next_node), number)
                fan_in[key] = fan_in.get(key, 0) + 1
            edges_of.append((node, edges))
        for node, edges in edges_of:
            if node is not running and any(fan_in[(id(next_node), number)] > 1 for next_node, number in edges):
                self.hook(node)

    def let_go(self) -> None:
        """Hold the last Node no longer (a Node keeps the Nodes after it, and their leaves, alive)."""
        self._node, self._outputs = None, frozenset()

    def formula_returned(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self._node = torch._C._current_autograd_node()
        self._outputs = frozenset(t._cdata for t in grad_inputs if isinstance(t, torch.Tensor))

    def op_for(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        """The op to run for `func(*args, **kwargs)`: `add_` for the engine's sum where a plain run's is in place."""
        if self._node is None:
            return func
        if torch._C._current_autograd_node() is not self._node:
            self.let_go()  # another Node runs, or none: the engine has added the last one's outputs
            return func
        if func is not _ADD or kwargs or len(args) != 2 or torch.is_grad_enabled():
            return func
        old, var = args
        if not (_plain(old) and _plain(var)) or var._cdata not in self._outputs:
            return func
        if old.shape != var.shape or old.dtype != var.dtype or old.device != var.device:
            return func
        if not _non_overlapping_and_dense(old):
            return func
        baseline = _baseline()
        if baseline is None:
            return func
        old_counts, var_counts = self._counts(old), self._counts(var)
        if var_counts[0] < baseline[0] or var_counts[1] < baseline[1]:
            return func  # read otherwise than the probe read them: assume nothing
        return _ADD_ if old_counts == baseline else func

    def _counts(self, tensor: torch.Tensor) -> tuple[int, int]:
        """References to the tensor's TensorImpl and storage, less the storage's holders a plain run has not."""
        tensor_refs, storage_refs = _counts(tensor)
        return tensor_refs, storage_refs - (self._storage_holders(tensor) if self._storage_holders is not None else 0)


@contextlib.contextmanager
def roots_hooked(accumulation: EngineAccumulation) -> Iterator[None]:
    """Every backward run meanwhile (`torch.autograd.backward` and `torch.autograd.grad` both call
    `torch.autograd._engine_run_backward`, torch 2.11-2.14) has its graph hooked from its roots before it runs."""
    run = getattr(torch.autograd, "_engine_run_backward", None)
    if run is None:  # another release: no Node is hooked and every sum stays out of place
        yield
        return

    def hooked(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        roots = [getattr(root, "grad_fn", None) or getattr(root, "node", None) for root in t_outputs]
        accumulation.hook_graph([root for root in roots if root is not None])
        try:
            return run(t_outputs, *args, **kwargs)
        finally:
            accumulation.let_go()

    with patch.object(torch.autograd, "_engine_run_backward", hooked):
        yield
