"""What keeps tensors alive in an eager step past their last use by an op: Python's local variables
(memplan.estimator.python_locals), the autocast cache, the autograd engine running a Node's formula, and libraries'
own Python objects (memplan.estimator.held_tensors). Observed while the traced step runs (memplan.estimator.trace)."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any
from unittest.mock import patch

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.estimator.checkpointing import recomputing
from memplan.estimator.composites import CompositeOp, PlainOpRule, composites_tracked
from memplan.estimator.engine_accumulation import EngineAccumulation, graph_nodes, roots_hooked
from memplan.estimator.held_tensors import (
    LIBRARIES_HOLDING_TENSORS,
    called_from_holding_library,
    python_holders_tracked,
)
from memplan.estimator.leaves import storage_key, tensors_in, wraps_local_tensors
from memplan.estimator.plain_formulas import PlainFormulaPaths
from memplan.estimator.python_locals import LocalBindings, holds_python_locals, tensors_held
from memplan.estimator.recorder import fake_device_query
from memplan.estimator.regenerated_views import RegeneratedViews

_TO_COPY = torch.ops.aten._to_copy.default


def _autocast_caches(source: object, cast: object) -> bool:
    """Whether autocast keeps this cast in its cache (autocast_mode.cpp, cached_cast).

    Autocast caches the lower-precision copy of a float32 leaf that requires grad (a parameter)
    until the outermost autocast region exits (torch.autocast.__exit__ -> clear_autocast_cache),
    so each weight is cast once per forward and its copy lives through the whole forward even
    where nothing saves it (inside checkpointed blocks). Recomputation re-enters autocast and
    caches again until it leaves. The cache itself is C++ state the graph cannot see: the copy's
    finalizer tells when it let go.
    """
    return (
        isinstance(source, torch.Tensor)
        and isinstance(cast, torch.Tensor)
        and source.dtype == torch.float32
        and cast.dtype == torch.get_autocast_dtype("cpu")
        and source.requires_grad
        and source.is_leaf
        and not source._is_view()
        and torch.is_autocast_cache_enabled()
        and _inside_autocast()
    )


def _inside_autocast() -> bool:
    # Inside an autocast kernel the AutocastCPU key is excluded, so is_autocast_enabled() reads
    # False there; the nesting count torch.autocast keeps (autocast_mode.py) says whether a region
    # is open. It has no getter: read it by a step up and back.
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return nesting > 0


class EagerLifetimes(TorchDispatchMode):
    """What keeps tensors alive in eager execution past their last use by an op in the graph.

    - A function's local variables live until it returns. GPT-2's attention keeps the fused q/k/v
      storage in locals through its output projection; inside a checkpointed block nothing else
      holds it. At every op the model-code frames on the Python stack are noted; when one is gone,
      it has returned, and its last locals lived until then (a returned frame we hold keeps them).
    - The autograd engine keeps a Node's incoming gradient and its unpacked saved tensors alive
      until the whole formula returns (torch/csrc/autograd/engine.cpp, call_function), past their
      last use by any single op of it. A post-hook on every Node marks where its formula ends: the
      additions that follow (gradient accumulation into the next Node's input buffer) are not part
      of it, and a pre-hook where it starts: what a Node's tensor pre-hooks run before it (FSDP2's
      unshard before a module's backward) is not either. The graph is hooked as backward() is
      called, roots included. Recomputation inside a checkpoint runs with grad mode on, which tells
      its ops apart.
    - A leaf that requires grad but is no parameter (an embedding's output made to require grad by
      transformers' `enable_input_require_grads`, the recipe for gradient checkpointing with frozen
      embeddings; a reentrant checkpoint's detached inputs) is held by its AccumulateGrad Node as long
      as the graph lives (torch/csrc/autograd/functions/accumulate_grad.h, `variable`), past its last
      use in the forward: here, until the backward that runs the graph returns, as do the tensors it
      runs from (a reentrant checkpoint's recomputed output, the root of the backward its own
      backward runs, is held by torch's frame, which memplan does not watch, until after it reads
      the detached inputs' gradients). The loop lets the loss, and with it the graph, go as the
      backward returns; a step that keeps the loss longer keeps the leaf longer, which is not
      modelled. The leaf's own Python object may outlive it here, held by the trace's bookkeeping,
      so its finalizer would say too late. (The gradient the backward leaves in the leaf's `.grad`
      is held as long too; no case where that outlives its last read and meets the peak has been
      found, so it is left to the graph.)
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo unless
        # this says no (torch/utils/_python_dispatch.py). Nothing is compiled inside a trace, and
        # the wrapper cost microseconds on each of a step's tens of thousands of dispatches.
        return False

    def __init__(
        self,
        node_count: Callable[[], int],
        storage_holders: Callable[[torch.Tensor], int] | None = None,
        target: str = "cpu",
    ) -> None:
        """`storage_holders(tensor)`: references to the tensor's storage that the trace keeps and a plain run has not
        (GraphRecorder.aliases_of); `target`: the device the step is traced for (which formulas' plain paths run)."""
        super().__init__()
        self.node_count = node_count
        self.backward_node_ops: list[list[int]] = []
        # For each of them, what the Node returned (its outputs as validate_outputs left them), where its post-hook
        # saw them: None where it did not (formula_blocks.formula_blocks)
        self.formula_results: list[frozenset[StorageWeakRef] | None] = []
        # For each of them, the last graph node the engine ran for its Node (evaluate_function): the formula, then
        # the additions that accumulate what it returned into the next Nodes' input buffers. What the Node
        # returned is held until then (formula_blocks.formula_blocks's caller).
        self.evaluation_ends: list[int] = []
        self.formula_casts: list[int] = []  # graph nodes: weights cast into the autocast cache inside a formula
        self.python_formulas: list[bool] = []  # for each of backward_node_ops: a Python autograd Function's backward
        self.formula_nodes: list[str] = []  # for each of backward_node_ops: its Node's class name
        self.local_lifetimes: list[tuple[StorageWeakRef, int]] = []
        # Storages a checkpoint's recomputation saved for the backward: held by the formula that unpacks them, not by
        # its Node (recomputed_for_backward)
        self.recomputed_saved: set[StorageWeakRef] = set()
        self._frames: list[FrameType] = []  # model-code frames on the stack, outermost first
        self._bindings: dict[int, LocalBindings] = {}  # id of each of them -> what its variables held when read
        self._depth: dict[int, int] = {}  # id of each of them -> its index there
        self._keeps_locals: dict[object, bool] = {}
        self._current: object = None
        self._formula_node: object = None  # the Node whose formula backward_node_ops[-1] holds
        self._formula_done = False
        self._formula_starting = False  # a Node's pre-hook ran: the next ops are its formula's
        self._in_formula = False
        self._hooked = False
        self._finished = False  # finish() ran: the step it watched is over
        # Leaves of the graph being run that are no parameters, weakly: a reference would keep them alive.
        self._graph_leaves: list[weakref.ref[torch.Tensor]] = []
        self._regenerated_views = RegeneratedViews(node_count, self.local_lifetimes)
        # The ops of the C++ composite running now, where one is watched (memplan.estimator.composites).
        self.composite_ops: list[CompositeOp] | None = None
        # While a watched composite with a subclass branch runs: (op, its args, the call's ops so far) -> the op its
        # plain path runs (memplan.estimator.math_attention.plain_attention_op).
        self.composite_plain_op: PlainOpRule | None = None
        self._plain_paths = PlainFormulaPaths(target)
        # The engine's sums of a tensor's gradients, in place where a plain run's are; the recorder's aliases are
        # references to a storage that a plain run has not (memplan.estimator.engine_accumulation).
        self.accumulation = EngineAccumulation(storage_holders)

    def _formula_called(self, grad_outputs: object) -> None:
        self._formula_starting = True
        # The frames that returned since the last op are let go now, not at the next op: a Python
        # autograd Function's backward (DeepSpeed's ZeRO-3 linear) returns a weight's gradient from
        # its frame's locals, which live on in the frame while memplan holds it, and AccumulateGrad,
        # which may run next, adopts an incoming gradient only where nothing else refers to it
        # (accumulate_grad.h, is_tensor_stealable): it would copy it instead, which the run does not.
        if not self._finished:  # a Node of an earlier trace's graph, run later, keeps its hooks
            self._observe_frames(self.node_count() - 1)

    def python_formula_returned(self) -> None:
        """A Python autograd Function's backward returned: what the engine runs next for its Node (a cast of a
        gradient to its input's dtype) is no part of its formula."""
        if torch._C._current_autograd_node() is self._current:
            self._formula_done = True

    def _formula_returned(self, grad_inputs: object, grad_outputs: object) -> None:
        self._formula_done = True
        self._formula_starting = False
        if self.formula_results and torch._C._current_autograd_node() is self._formula_node:
            self.formula_results[-1] = frozenset(storage_key(tensor) for tensor in tensors_in(grad_inputs))

    def before_backward(self, tensors: object) -> list[StorageWeakRef]:
        """The backward of `tensors` is about to run: every Node of their graph, roots included, gets
        its hooks now, so the ops a root's tensor pre-hooks run are told from its formula too. Returns
        the storages that live at least until this backward returns: the tensors it runs from (the
        caller passed them: a reentrant checkpoint's recomputed output, held by a torch frame memplan
        does not watch, has no other use) and the graph's leaves that are no parameters (see the
        class's docstring)."""
        root_tensors = [tensor for tensor in tensors_in(tensors) if tensor.grad_fn is not None]
        leaf_keys = []
        if root_tensors:
            self._hooked = True
            self._hook_graph([tensor.grad_fn for tensor in root_tensors], running=None)
            leaves = [leaf for leaf in (reference() for reference in self._graph_leaves) if leaf is not None]
            leaf_keys = [storage_key(leaf) for leaf in leaves] + [storage_key(tensor) for tensor in root_tensors]
        self._graph_leaves.clear()
        return leaf_keys

    def backward_returned(self, leaf_keys: list[StorageWeakRef]) -> None:
        self.local_lifetimes += [(key, self.node_count() - 1) for key in leaf_keys]

    def _hook_graph(self, roots: list[Any], running: Any) -> None:
        """Hooks on every Node reachable from `roots` but `running`, whose formula runs already."""
        for node, _ in graph_nodes(roots):
            if node is not running:
                node.register_prehook(self._formula_called)
                node.register_hook(self._formula_returned)
            if type(node).__name__ == "AccumulateGrad" and not isinstance(node.variable, torch.nn.Parameter):
                self._graph_leaves.append(weakref.ref(node.variable))

    def _observe_frames(self, now: int) -> None:
        # Walk down only to the first model frame already known: what lies below it cannot have
        # changed, and every known frame above it has returned. This keeps the walk short per op.
        fresh: list[FrameType] = []
        survivor = -1
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            keeps = self._keeps_locals.get(frame.f_code)
            if keeps is None:
                keeps = self._keeps_locals[frame.f_code] = holds_python_locals(frame.f_code.co_filename)
            if keeps:
                survivor = self._depth.get(id(frame), -1)
                if survivor >= 0:
                    break
                fresh.append(frame)
            frame = frame.f_back
        for returned in self._frames[survivor + 1 :]:
            del self._depth[id(returned)]
            self._record_locals(returned, now)
            self._bindings.pop(id(returned)).release(now, self.local_lifetimes)
        del self._frames[survivor + 1 :]
        for frame in reversed(fresh):
            self._depth[id(frame)] = len(self._frames)
            self._frames.append(frame)
            self._bindings[id(frame)] = LocalBindings()
        # What the frames' variables hold now lives through the op about to run. A frame's variables change
        # only while it runs its own code, so the frames read are those that ran since the last op: the
        # innermost (where no new frame was entered above it), the one that has just called into new frames,
        # and the new frames themselves (their arguments).
        if not fresh:
            if self._frames:
                self._bindings[id(self._frames[-1])].read(self._frames[-1], now, self.local_lifetimes)
            return
        for frame in self._frames[max(survivor, 0) :]:
            self._bindings[id(frame)].read(frame, now, self.local_lifetimes)

    def _record_locals(self, frame: FrameType, end: int) -> None:
        """What the frame's variables hold as it returns (bound since its last op too) lived through `end`."""
        for value in frame.f_locals.values():
            self.local_lifetimes.extend((storage_key(tensor), end) for tensor in tensors_held(value))

    def held_until_released(self, owner: object, tensor: torch.Tensor) -> None:
        """`tensor` lives at least until `owner`, a Python object invisible to the graph, is freed."""
        weakref.finalize(owner, self._released, storage_key(tensor))

    def recomputed_for_backward(self, tensor: torch.Tensor) -> None:
        """`tensor` is one a checkpoint's recomputation saved for a Node's formula, which holds it once unpacked, until
        it returns; the Node does not (held_tensors._RecomputedTensors)."""
        self.recomputed_saved.add(storage_key(tensor))

    def _released(self, key: StorageWeakRef) -> None:
        self.local_lifetimes.append((key, self.node_count() - 1))

    def abandon(self) -> None:
        """The step failed: let go of its Nodes and frames. The Nodes held here hold this object in their hooks, in
        C++ where Python's collector cannot see the cycle, and the frames the model's tensors."""
        self._finished = True
        self._current = self._formula_node = None
        self._frames.clear()
        self._depth.clear()
        self._bindings.clear()

    def finish(self) -> None:
        self._finished = True
        self._current = self._formula_node = None  # as abandon() says
        end = self.node_count() - 1
        for frame in self._frames:
            self._record_locals(frame, end)
            self._bindings.pop(id(frame)).release(end, self.local_lifetimes)
        self._frames.clear()
        self._depth.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if (device := fake_device_query(func, args)) is not None:
            return device  # allocates nothing
        if wraps_local_tensors(types):
            return NotImplemented  # observed as the ops on its local tensors
        start = self.node_count()
        self._observe_frames(start - 1)
        self._regenerated_views.before(func, args)
        autograd_node = torch._C._current_autograd_node()
        func = self.accumulation.op_for(func, args, kwargs)  # the engine's sum, in place as a plain run's
        func = self._plain_paths.op_for(func, args)  # the path a plain run's formula takes (plain_formulas)
        if self.composite_ops is not None and self.composite_plain_op is not None:
            func = self.composite_plain_op(func, args, self.composite_ops)  # a composite's plain path
        out = func(*args, **(kwargs or {}))
        self._plain_paths.made(out)
        end = self.node_count() - 1
        if self.composite_ops is not None:
            self.composite_ops.append(CompositeOp.of(func, args, out, end))
        if func is _TO_COPY and _autocast_caches(args[0], out):
            self.held_until_released(out, out)
            if autograd_node is not None and not recomputing():
                # A formula that opens an autocast region of its own (DeepSpeed's ZeRO-3 linear; custom_bwd)
                # casts a weight into the cache, with grad mode on: the cache holds that copy until the region
                # exits, inside the formula, and the engine does not hold it (formula_casts).
                self.formula_casts.append(end)
        elif LIBRARIES_HOLDING_TENSORS and called_from_holding_library(sys._getframe(1)):
            for tensor in tensors_in(out):
                self.held_until_released(tensor, tensor)
        if autograd_node is None or torch.is_grad_enabled() or recomputing():
            return out
        if not self._hooked:  # the backward's first Node, inside its formula: the rest get hooks
            self._hooked = self._formula_starting = True
            self._hook_graph([autograd_node], running=autograd_node)
        if type(autograd_node).__name__ == "AccumulateGrad":
            # AccumulateGrad moves its incoming gradient into .grad (`new_grad = std::move(grads[0])`,
            # torch/csrc/autograd/functions/accumulate_grad.h), so the engine holds nothing through what
            # it and its hooks run: DeepSpeed's post-accumulate hook copies the gradient into its bucket
            # and points .grad elsewhere (`.data`), which frees it there.
            self._current = autograd_node
            return out
        if autograd_node is not self._current:
            self.backward_node_ops.append([])
            self.formula_results.append(None)
            self.evaluation_ends.append(end)
            self.python_formulas.append(isinstance(autograd_node, torch.autograd.function.BackwardCFunction))
            self.formula_nodes.append(type(autograd_node).__name__)
            self._formula_node = autograd_node
            self._current = autograd_node
            self._formula_done = False
            self._in_formula = False
        if self._formula_starting:
            self._in_formula = True
        self._formula_starting = False
        # Ops a Node's tensor pre-hooks run (FSDP2's unshard before a module's backward) come
        # before its pre-hook and are no part of the formula.
        if self._in_formula and not self._formula_done:
            self.backward_node_ops[-1].extend(range(start, end + 1))
        self.evaluation_ends[-1] = end
        return out


@contextlib.contextmanager
def lifetimes_tracked(eager_lifetimes: EagerLifetimes) -> Iterator[None]:
    """How long Python, the autocast cache, checkpoint inputs and autograd Functions' contexts keep each
    tensor, while the step runs."""
    backward = torch.autograd.backward

    def hooked_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        leaves = eager_lifetimes.before_backward(tensors)
        returned = backward(tensors, *args, **kwargs)
        eager_lifetimes.backward_returned(leaves)
        return returned

    # A Python autograd Function's backward (PyNode::apply, python_function.cpp) drops its incoming gradients and
    # saved tensors as its Python call returns, before the engine casts a returned gradient to its input's dtype
    # (validate_outputs: DeepSpeed's ZeRO-3 linear under autocast returns float16 gradients of float32 weights);
    # the formula ends where the Python call does.
    def returning(apply: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any) -> Any:
            result = apply(self, *args)
            eager_lifetimes.python_formula_returned()
            return result

        return run

    function_class = torch.autograd.function.BackwardCFunction
    # Tensor.backward looks it up as torch.autograd.backward (torch/_tensor.py).
    with (
        eager_lifetimes,
        python_holders_tracked(eager_lifetimes),
        composites_tracked(eager_lifetimes),
        patch.object(torch.autograd, "backward", hooked_backward),
        roots_hooked(eager_lifetimes.accumulation),
        contextlib.ExitStack() as applies,
    ):
        # `apply_boxed` (grads in a list the backward may empty) is torch 2.13's; torch 2.11 has `apply` alone.
        for name in ("apply", "apply_boxed"):
            if hasattr(function_class, name):
                applies.enter_context(patch.object(function_class, name, returning(getattr(function_class, name))))
        try:
            yield
        except BaseException:
            eager_lifetimes.abandon()  # a failed step never reaches finish()
            raise
