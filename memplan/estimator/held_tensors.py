"""Python objects the op graph cannot see that keep tensors alive, watched while a step is traced.

Each holder is patched in for the trace only; when one is made, the tensors it holds are reported to
the observer with the holder, whose finalizer then tells when it let go (`held_until_released`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, FunctionType, MethodType
from typing import Any, Protocol
from unittest.mock import patch

import torch
import torch.utils.checkpoint as checkpoint_module
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from memplan.estimator.leaves import tensors_in, wraps_local_tensors
from memplan.estimator.recorder import fake_device_query


class HolderObserver(Protocol):
    def held_until_released(self, owner: object, tensor: torch.Tensor) -> None: ...

    def recomputed_for_backward(self, tensor: torch.Tensor) -> None: ...


@contextlib.contextmanager
def python_holders_tracked(eager_lifetimes: HolderObserver) -> Iterator[None]:
    with (
        _selective_cache_lifetimes(eager_lifetimes),
        _checkpoint_input_lifetimes(eager_lifetimes),
        _function_context_lifetimes(eager_lifetimes),
    ):
        yield


@contextlib.contextmanager
def _selective_cache_lifetimes(eager_lifetimes: HolderObserver) -> Iterator[None]:
    """Selective checkpointing keeps each saved output in a cache entry until its recomputation
    takes it, or, when the recomputation stops early before that op, until the checkpoint's
    frame is freed after the region's backward (torch/utils/checkpoint.py, _VersionWrapper in
    _CachingTorchDispatchMode's storage). The cache is Python state the graph cannot see: a
    Llama MLP's down_proj output stayed live into the backward of the real run, not the trace.
    """
    original = checkpoint_module._VersionWrapper

    class ObservedEntry(original):  # type: ignore[misc, valid-type]
        def __init__(self, val: object) -> None:
            super().__init__(val)
            if isinstance(val, torch.Tensor):
                eager_lifetimes.held_until_released(self, val)

    with patch.object(checkpoint_module, "_VersionWrapper", ObservedEntry):
        yield


@contextlib.contextmanager
def _checkpoint_input_lifetimes(eager_lifetimes: HolderObserver) -> Iterator[None]:
    """A non-reentrant checkpoint keeps the tensors passed to it (args and kwargs) for its
    recomputation until its frame is freed, when the last autograd Node of the region that saved a
    tensor is released, near the end of the region's backward (torch/utils/checkpoint.py: the frame's
    `saved_args` and `recompute_fn`'s closure since torch 2.12, its `input_saver` Node on 2.11). An
    input read by no op of the region's backward lives past its last read (the recomputation):
    T5's position biases, made by the first block and passed to each later one, stayed live in the
    real run through each block's backward, not in the trace (t5-selective-long 4.6% low).
    The checkpointed function is an input too: `recompute_fn`'s closure holds it, and with it what it
    holds (`held_by_callable`): transformers' checkpointed layers pass their keyword arguments so
    (`partial(forward, self, **kwargs)`, modeling_layers.py, GradientCheckpointingLayer), as users do with
    a partial or a lambda over a mask; a Llama's position ids, read only by the recomputation, stayed live
    through its region's backward in the real run, not in the trace (256 B low; a [b, s, 4h] mask held
    by a partial: 95,040 B, 6.7%, low).
    The frame is Python state the graph cannot see: its finalizer tells when it let go.
    """
    original = checkpoint_module._CheckpointFrame

    class ObservedFrame(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _observe_recomputed(self, eager_lifetimes)

        def save_inputs(self, *args: Any) -> None:
            super().save_inputs(*args)
            # Called by _checkpoint_without_reentrant_generator (torch 2.13-2.14), whose parameters `fn` and
            # `kwargs` are the checkpointed function and its keyword arguments.
            inputs = sys._getframe(1).f_locals
            # A positional input is kept as a SavedTensor, packed by the saved-tensor hooks active as the
            # forward runs: an enclosing checkpoint's (nested checkpoints) packs it into a holder that keeps
            # no tensor, so only what the SavedTensor holds (`data`) is held (a nested region's inputs were
            # held through the outer region's backward: 262,144 B, 9%, high on three nested blocks).
            saved = [arg.data for arg in self.saved_args if isinstance(arg, checkpoint_module.SavedTensor)]
            held = tensors_in((saved, inputs.get("kwargs"))) + held_by_callable(inputs.get("fn"))
            for tensor in held:
                eager_lifetimes.held_until_released(self, tensor)

    class ObservedFrameBeforeSaveInputs(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # torch 2.11-2.12: the frame has no save_inputs (its inputs go to `_NoopSaveInputs`); made by
            # _checkpoint_without_reentrant_generator, whose parameters `fn`, `args` and `kwargs` are the
            # checkpointed function and its inputs. Nested checkpoints' inputs are held whole here (the safe side).
            inputs = sys._getframe(1).f_locals
            held = tensors_in((inputs.get("args"), inputs.get("kwargs"))) + held_by_callable(inputs.get("fn"))
            for tensor in held:
                eager_lifetimes.held_until_released(self, tensor)
            _observe_recomputed(self, eager_lifetimes)

    observed = ObservedFrame if hasattr(original, "save_inputs") else ObservedFrameBeforeSaveInputs
    with patch.object(checkpoint_module, "_CheckpointFrame", observed):
        yield


class _RecomputedTensors(weakref.WeakKeyDictionary):  # type: ignore[type-arg]
    """One graph task's entries of a non-reentrant checkpoint frame's `recomputed` (torch/utils/checkpoint.py,
    torch 2.11-2.14): `_recomputation_hook`'s pack hook stores each tensor the recomputation saves under the handle of
    the forward's holder, and the frame's unpack hook hands it to the Node's formula and drops the handle
    (`holder.handles[gid] = None`), which takes the entry out. From then on only the formula's locals hold it, not the
    Node (a SavedVariable with hooks keeps the holder, not the tensor: saved_variable.cpp): it goes as the formula
    returns, before the engine's validate_outputs sums or casts what it returned (engine.cpp, call_function)."""

    def __init__(self, observer: HolderObserver) -> None:
        super().__init__()
        self._observer = observer

    def __setitem__(self, key: object, value: torch.Tensor) -> None:
        if isinstance(value, torch.Tensor):
            self._observer.recomputed_for_backward(value)
        super().__setitem__(key, value)


def _observe_recomputed(frame: Any, observer: HolderObserver) -> None:
    """Report to `observer` what the checkpoint frame's recomputations save for the backward (_RecomputedTensors)."""
    frame.recomputed = collections.defaultdict(functools.partial(_RecomputedTensors, observer))


@contextlib.contextmanager
def _function_context_lifetimes(eager_lifetimes: HolderObserver) -> Iterator[None]:
    """A custom autograd Function's forward may keep tensors as attributes of its context
    (`ctx.A = A`, `ctx.tensors = (CAt, subA, A)` in bitsandbytes' 8-bit matmuls) instead of
    `save_for_backward`. The context is the Function's backward Node: what it holds lives until
    the Node is freed, after its backward has run, and a checkpointed region cannot drop it, as it
    drops saved tensors. bitsandbytes' MatMul8bitFp keeps its input so: under checkpointing the real
    CPU run held each int8 layer's input into the backward, not the trace (3% low). A callable kept
    so holds what it holds (`held_by_callable`): torch's reentrant checkpoint keeps the checkpointed function
    as `ctx.run_function`, and with it the tensors of a partial's arguments or a lambda's closure
    (transformers' layers' keyword arguments, a user's mask) until its graph goes.
    """
    original = vars(torch.autograd.function.Function)["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        outputs = original.__func__(cls, *args, **kwargs)
        nodes = {id(node): node for node in map(_grad_fn, tensors_in(outputs)) if node is not None}
        for node in nodes.values():
            for value in vars(node).values():
                for tensor in tensors_in(value) + held_by_callable(value):
                    eager_lifetimes.held_until_released(node, tensor)
        return outputs

    with patch.object(torch.autograd.function.Function, "apply", classmethod(apply)):
        yield


def held_by_callable(value: object) -> list[torch.Tensor]:
    """The tensors a Python callable keeps alive: a functools.partial's arguments, a function's closure cells
    and default arguments, a bound method's function, each followed into the callables among them. A module
    is not looked into (its parameters and buffers are the model's own), nor is a tensor's own method."""
    held: list[torch.Tensor] = []
    seen: set[int] = set()
    pending = [value]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, functools.partial):
            contents: list[object] = [item.func, *item.args, *item.keywords.values()]
        elif isinstance(item, MethodType):
            contents = [item.__func__]
        elif isinstance(item, FunctionType):
            cells = []
            for cell in item.__closure__ or ():
                try:
                    cells.append(cell.cell_contents)
                except ValueError:  # a cell not yet filled
                    pass
            contents = [*cells, *(item.__defaults__ or ()), *(item.__kwdefaults__ or {}).values()]
        else:
            continue
        for content in contents:
            if isinstance(content, FunctionType | MethodType | functools.partial):
                pending.append(content)
            else:
                held.extend(tensors_in(content))
    return held


def _grad_fn(tensor: torch.Tensor) -> object | None:
    """The custom Function's backward Node that made `tensor`, or None."""
    node = tensor.grad_fn
    return node if isinstance(node, torch.autograd.function.BackwardCFunction) else None


# Source folders (or single files) of libraries that keep tensors they make in Python objects past
# their last use by an op, until they drop them: what an op called from their code makes lives until
# its Python object is freed. FSDP2 keeps the last all-gather's buffers until the next all-gather, and the last
# reduce-scatter's input until the next reduce-scatter (AllGatherState, ReduceScatterState in
# _fsdp_param_group.py: on CUDA, until the collective's stream is done with them). Registered by
# memplan.distributed.fsdp and .deepspeed.
LIBRARIES_HOLDING_TENSORS: set[str] = set()
_OPS_FILE = os.path.join(os.path.dirname(torch.__file__), "_ops.py")


def called_from_holding_library(frame: FrameType | None) -> bool:
    """Whether the Python code that called an op (`frame`, the first frame outside the dispatch mode)
    is a library's in LIBRARIES_HOLDING_TENSORS (its directory, or the file itself); torch.ops' own call
    wrapper is looked through."""
    if frame is not None and frame.f_code.co_filename == _OPS_FILE:
        frame = frame.f_back
    if frame is None:
        return False
    filename = frame.f_code.co_filename
    return filename in LIBRARIES_HOLDING_TENSORS or os.path.dirname(filename) in LIBRARIES_HOLDING_TENSORS


_OPTIMIZER_DIR = os.path.join(os.path.dirname(torch.__file__), "optim") + os.sep


class OptimizerLocals(TorchDispatchMode):
    """How long torch's optimizer functions keep their temporaries in local variables.

    A for-loop optimizer keeps the last parameter's temporary in a local until the next parameter's
    replaces it: `_single_tensor_adam` computes each `denom`, and the previous one lives through
    the next parameter's arithmetic (torch/optim/adam.py). A graph's last uses free it at its own
    parameter's update, one parameter's worth too early (AdamW on the CPU: 1,024 B low on a stack of
    Linear layers, 4,352 B on a small ViT). At every op of the step this notes which tensors the
    optimizer's frames hold in locals (one level of lists, as for foreach's): one held at the last
    op and not now lived until the op before this one; what a frame holds when it returns, until
    then. Ends are node indices, from `node_count` (the index the current op will get).
    """

    def __init__(self, node_count: Callable[[], int], key: Callable[[torch.Tensor], Any] | None = None) -> None:
        super().__init__()
        self._node_count = node_count
        self._key = key or (lambda tensor: StorageWeakRef(tensor.untyped_storage()))
        self._held: dict[int, FrameLocals] = {}  # id(frame) -> what its locals held at the last look
        # (a tensor's storage, the last node it lives through): the storage's key, not the tensor, which a reference
        # here would keep alive past the step (a gradient the step's zero_grad frees, while the user's step runs on).
        self.lifetimes: list[tuple[Any, int]] = []
        # Watching: a user's own step (--step) runs its optimizers' steps among its other ops, so the mode is on
        # only between each optimizer step's hooks (watch_steps).
        self.active = True
        self._entered = False  # watch_steps: the mode is on the dispatch mode stack now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if (device := fake_device_query(func, args)) is not None:
            # Allocates nothing, and frames hold what they held at the last op: torch's foreach optimizers group
            # every parameter, gradient and state tensor by device first, one query each (gpt2: 740 a step).
            return device
        if wraps_local_tensors(types):
            return NotImplemented  # observed as the ops on its local tensors
        if self.active:
            self._observe(self._node_count() - 1)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def watch_steps(self) -> Iterator[None]:
        """Watch every optimizer's step (torch.optim's global step hooks) and nothing between them: what a step's
        frames held as it returned lived until then (finish).

        The mode is on the dispatch mode stack only from a step's pre-hook to its post-hook, not through the rest of
        the user's step: a mode above memplan's own re-boxes each op's arguments as it passes the op on (one more
        reference to each tensor's TensorImpl), and the engine's sums of gradients, told in place by those counts
        (memplan.estimator.engine_accumulation), all stayed out of place in a --step's backward (+262,136 B, a
        logits-sized gradient, on the zoo's GPT-2 with a class-weighted, label-smoothed cross-entropy)."""
        self.active = False

        def started(optimizer: object, args: object, kwargs: object) -> None:
            self.active = True
            if not self._entered:  # (an optimizer stepping another from its own step is watched from the first)
                self.__enter__()
                self._entered = True

        def returned(optimizer: object, args: object, kwargs: object) -> None:
            self.finish()
            self.active = False
            if self._entered and _current_dispatch_mode() is self:
                self._entered = False
                self.__exit__(None, None, None)

        before = register_optimizer_step_pre_hook(started)
        after = register_optimizer_step_post_hook(returned)
        try:
            yield
        finally:
            before.remove()
            after.remove()
            if self._entered:  # a step that raised (its post-hook never ran), caught by the user's step or not
                self._entered = False
                self.__exit__(None, None, None)

    def _observe(self, before: int) -> None:
        frames: dict[int, FrameType] = {}
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(_OPTIMIZER_DIR):
                frames[id(frame)] = frame
            frame = frame.f_back
        for key in list(self._held):
            if key not in frames:  # returned: its locals went with it
                self._release(self._held.pop(key).tensors.values(), before)
        for key, frame in frames.items():
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = FrameLocals(frame)
            self._release(held.look(), before)

    def _release(self, tensors: Iterable[torch.Tensor], end: int) -> None:
        self.lifetimes.extend((self._key(tensor), end) for tensor in tensors)

    def finish(self) -> None:
        """The step returned: what its frames still held lived until its last op."""
        end = self._node_count() - 1
        for held in self._held.values():
            self._release(held.tensors.values(), end)
        self._held.clear()


class FrameLocals:
    """The tensors one optimizer frame holds in its locals, and in lists and tuples among them, each counted once
    per holder (a local bound to it, a list or tuple holding it), kept up to date look by look (`look`).

    A holder is known by identity: a tensor bound to a local by its id, a list or tuple by its id and length (kept
    here, so that its id is no other's while it is known). A list or tuple known at the last look, the same object
    of the same length, is taken to hold what it held: torch's optimizers bind a new list to a name rather than
    replace a list's items. A parameter group's lists (a foreach step's, the model's every parameter, gradient and
    state) so stay known from op to op, and a look costs the holders that changed, not every tensor they hold:
    gpt2's AdamW step, a dozen lists of 148 tensors at each of its 1,336 ops, took half of its first trace when
    each look gathered them all anew (0.64 s of 1.23 s, the CPU target)."""

    __slots__ = ("_counts", "_frame", "_holders", "tensors")

    def __init__(self, frame: FrameType) -> None:
        self._frame = frame
        # holder's identity -> (the holder, its tensors by id)
        self._holders: dict[tuple[int, int], tuple[object, dict[int, torch.Tensor]]] = {}
        self._counts: dict[int, int] = {}  # a tensor's id -> how many holders hold it
        self.tensors: dict[int, torch.Tensor] = {}  # the tensors held, by id

    def look(self) -> list[torch.Tensor]:
        """Read the frame's locals again; the tensors its locals held at the last look and hold no more."""
        holders: dict[tuple[int, int], tuple[object, dict[int, torch.Tensor]]] = {}
        known = self._holders
        gained = []
        for value in self._frame.f_locals.values():
            if isinstance(value, tuple | list):
                key = (id(value), len(value))
            elif isinstance(value, torch.Tensor):
                key = (id(value), -1)  # (no list's length)
            else:
                continue
            if key in holders:  # (bound to two names)
                continue
            holder = known.get(key)
            if holder is None:
                if key[1] < 0:
                    holder = (value, {key[0]: value})
                else:
                    holder = (value, {id(item): item for item in value if isinstance(item, torch.Tensor)})
                gained.append(holder[1])
            holders[key] = holder
        if not gained and len(holders) == len(known):  # every holder still known: none was let go
            return []
        counts, tensors = self._counts, self.tensors
        for held in gained:  # counted before what is let go, so that a tensor passed on to a new holder stays held
            for ident, tensor in held.items():
                counts[ident] = counts.get(ident, 0) + 1
                tensors[ident] = tensor
        released = []
        for key, (_, held) in known.items():
            if key in holders:
                continue
            for ident in held:
                counts[ident] -= 1
                if not counts[ident]:
                    del counts[ident]
                    released.append(tensors.pop(ident))
        self._holders = holders
        return released
