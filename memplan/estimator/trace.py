"""Capture one steady-state iteration as an FX graph over fake tensors (design.md §3).

The step is traced *statefully*: the model's own fake parameters, `.backward()` through the autograd
engine, then the real `torch.optim` optimizer. Parameters, buffers, optimizer state and existing
gradients become graph constants; the batch becomes the graph's placeholders.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import MemplanError, TraceError
from memplan.estimator.checkpointing import recomputing
from memplan.estimator.cuda.autocast import cuda_autocast_policy
from memplan.estimator.cuda.kernels import cuda_kernels
from memplan.estimator.fake_conversions import fake_friendly_conversions
from memplan.estimator.fake_mode import TracingFakeMode
from memplan.estimator.held_tensors import OptimizerLocals, python_holders_tracked
from memplan.estimator.hf_patches import no_weight_init, real_run_paths
from memplan.estimator.leaves import tensors_in
from memplan.estimator.loop import (
    STORAGE_DTYPES,
    TrainingState,
    communication_tensors,
    current_grads,
    custom_step,
    drop_grads,
    gradients_outlive_the_step,
    iteration,
    micro_batch,
    model_tensors,
    optimizer_step,
    optimizer_tensors,
    prepare,
)
from memplan.estimator.opgraph import OpGraph
from memplan.estimator.recorder import GraphRecorder, fake_device_query
from memplan.estimator.replay import OptimizerRecording
from memplan.finetune.bnb_kernels import int8_matmul_as_on_cuda
from memplan.finetune.quantize import logical_numel
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings


@dataclass
class TracedStep:
    """The captured graph plus what memplan knows about its storages and phases."""

    graph: OpGraph  # every node's output in meta["val"] (memplan.estimator.recorder)
    settings: TrainingSettings
    forward_end: int  # index of the first node after the forward pass (and loss)
    backward_end: int  # index of the first node of the optimizer step
    storage_categories: dict[StorageWeakRef, str]
    storage_bytes: dict[StorageWeakRef, int]  # of the categorized storages, used by the graph or not
    node_modules: list[str | None]
    parameter_count: int
    trainable_parameter_count: int
    checkpointed_blocks: list[str]
    python_lifetimes: list[tuple[StorageWeakRef, int]]  # (storage, last node before Python let go of it)
    backward_node_ops: list[list[int]]  # graph nodes run by each autograd Node's backward formula
    seconds: float
    optimizer_recording: OptimizerRecording | None = None  # replayable into later traces (replay.py)
    unknown_target_ops: tuple[str, ...] = ()  # ran with a target behaviour memplan does not know
    # Storages alive when the iteration starts that Python frees during it, never read by the graph:
    # (storage, bytes, last node before it was freed). The previous step's gradients under
    # --loop zero-grad-before-backward.
    released_early: tuple[tuple[StorageWeakRef, int, int], ...] = ()


def storage_key(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


@contextlib.contextmanager
def constant_item() -> Iterator[None]:
    """Let optimizers call `.item()` on fake tensors (step counters, Adafactor's norms).

    The value only steers arithmetic, never which tensors are allocated, so a constant is safe.
    """
    previous = FakeTensor.__dict__.get("item")

    def item(self: FakeTensor) -> float | int | bool:
        if self.dtype == torch.bool:
            return False
        return 2.0 if self.dtype.is_floating_point else 2

    FakeTensor.item = item  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del FakeTensor.item
        else:
            FakeTensor.item = previous  # type: ignore[method-assign]


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN_DIR = os.path.join(_TORCH_DIR, "nn") + os.sep


def _holds_python_locals(filename: str) -> bool:
    """Frames whose local variables can keep a model's tensors alive: model code, not torch's machinery."""
    if filename == __file__:
        return False
    return not filename.startswith(_TORCH_DIR) or filename.startswith(_TORCH_NN_DIR)


class _ModuleTracker:
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

    def __enter__(self) -> _ModuleTracker:
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


class _EagerLifetimes(TorchDispatchMode):
    """What keeps tensors alive in eager execution past their last use by an op in the graph.

    - A function's local variables live until it returns. GPT-2's attention keeps the fused q/k/v
      storage in locals through its output projection; inside a checkpointed block nothing else
      holds it. At every op the model-code frames on the Python stack are noted; when one is gone,
      it has returned, and its last locals lived until then (a returned frame we hold keeps them).
    - The autograd engine keeps a Node's incoming gradient and its unpacked saved tensors alive
      until the whole formula returns (torch/csrc/autograd/engine.cpp, call_function), past their
      last use by any single op of it. A post-hook on every Node marks where its formula ends: the
      additions that follow (gradient accumulation into the next Node's input buffer) are not part
      of it. Recomputation inside a checkpoint runs with grad mode on, which tells its ops apart.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo unless
        # this says no (torch/utils/_python_dispatch.py). Nothing is compiled inside a trace, and
        # the wrapper cost microseconds on each of a step's tens of thousands of dispatches.
        return False

    def __init__(self, node_count: Callable[[], int]) -> None:
        super().__init__()
        self.node_count = node_count
        self.backward_node_ops: list[list[int]] = []
        self.local_lifetimes: list[tuple[StorageWeakRef, int]] = []
        self._frames: list[FrameType] = []  # model-code frames on the stack, outermost first
        self._depth: dict[int, int] = {}  # id of each of them -> its index there
        self._keeps_locals: dict[object, bool] = {}
        self._current: object = None
        self._formula_done = False
        self._hooked = False

    def _formula_returned(self, grad_inputs: object, grad_outputs: object) -> None:
        self._formula_done = True

    def _hook_graph(self, root: Any) -> None:
        # Keyed by id(), so every visited Node's Python wrapper is kept alive in `seen` until the
        # walk ends: a C++ Node's wrapper is made anew for each `next_functions` read and freed with
        # it, and on torch 2.10-2.12 a freed wrapper's id was soon another Node's, whose hook was
        # then skipped (checkpointed predictions 2-3.5% high).
        seen: dict[int, Any] = {}
        stack = [root]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            if node is not root:
                node.register_hook(self._formula_returned)
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _observe_frames(self, now: int) -> None:
        # Walk down only to the first model frame already known: what lies below it cannot have
        # changed, and every known frame above it has returned. This keeps the walk short per op.
        fresh: list[FrameType] = []
        survivor = -1
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            keeps = self._keeps_locals.get(frame.f_code)
            if keeps is None:
                keeps = self._keeps_locals[frame.f_code] = _holds_python_locals(frame.f_code.co_filename)
            if keeps:
                survivor = self._depth.get(id(frame), -1)
                if survivor >= 0:
                    break
                fresh.append(frame)
            frame = frame.f_back
        for returned in self._frames[survivor + 1 :]:
            del self._depth[id(returned)]
            self._record_locals(returned, now)
        del self._frames[survivor + 1 :]
        for frame in reversed(fresh):
            self._depth[id(frame)] = len(self._frames)
            self._frames.append(frame)

    def _record_locals(self, frame: FrameType, end: int) -> None:
        for value in frame.f_locals.values():
            # One level of containers: a model's output dict (ModelOutput is one) held in a local
            # keeps its logits alive (`out = model(...)`, then `out.loss.backward()`).
            items = (
                value if isinstance(value, tuple | list) else value.values() if isinstance(value, dict) else (value,)
            )
            for item in items:
                if isinstance(item, torch.Tensor):
                    self.local_lifetimes.append((storage_key(item), end))

    def held_until_released(self, owner: object, tensor: torch.Tensor) -> None:
        """`tensor` lives at least until `owner`, a Python object invisible to the graph, is freed."""
        weakref.finalize(owner, self._released, storage_key(tensor))

    def _released(self, key: StorageWeakRef) -> None:
        self.local_lifetimes.append((key, self.node_count() - 1))

    def finish(self) -> None:
        end = self.node_count() - 1
        for frame in self._frames:
            self._record_locals(frame, end)
        self._frames.clear()
        self._depth.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if (device := fake_device_query(func, args)) is not None:
            return device  # allocates nothing
        start = self.node_count()
        self._observe_frames(start - 1)
        autograd_node = torch._C._current_autograd_node()
        out = func(*args, **(kwargs or {}))
        end = self.node_count() - 1
        if func is _TO_COPY and _autocast_caches(args[0], out):
            self.held_until_released(out, out)
        if autograd_node is None or torch.is_grad_enabled() or recomputing():
            return out
        if not self._hooked:
            self._hooked = True
            self._hook_graph(autograd_node)
        if autograd_node is not self._current:
            self.backward_node_ops.append([])
            self._current = autograd_node
            self._formula_done = False
        if not self._formula_done:
            self.backward_node_ops[-1].extend(range(start, end + 1))
        return out


def _warm_up_optimizer(state: TrainingState) -> None:
    """Create the optimizer state a steady-state iteration finds (one untraced step on zero grads)."""
    if state.optimizer is None:
        return
    for param in state.trainable:
        param.grad = torch.zeros_like(param)
    with constant_item():
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


def _trace_custom_step(
    spec: ModelSpec,
    settings: TrainingSettings,
    state: TrainingState,
    fake_mode: FakeTensorMode,
    recorder: GraphRecorder,
    previous_grads: list[tuple[StorageWeakRef, int]],
    started: float,
) -> TracedStep:
    """trace_step for `--step`: the user's whole iteration, recorded as it runs.

    Gradients the iteration starts with (what the step left last time) that it frees count until
    the op where they went; the gradients its optimizer step finds are gradients; those it leaves
    allocated outlive the iteration."""
    boundaries: dict[str, int] = {}
    freed_at: dict[StorageWeakRef, int] = {}
    finalizers = _note_when_freed(current_grads(state), freed_at, recorder.node_count)  # holding none of them
    seen: list[tuple[StorageWeakRef, int]] = []

    def marker(phase: str) -> None:
        boundaries[phase] = recorder.node_count()

    def on_step(grads: list[torch.Tensor]) -> None:
        seen.extend((storage_key(grad), grad.untyped_storage().nbytes()) for grad in grads)

    eager_lifetimes = _EagerLifetimes(recorder.node_count)
    tracker = _ModuleTracker(state.built_model, recorder.node_count)
    try:
        target_kernels = _target_kernels(settings)
        with fake_mode, tracker, real_run_paths(), target_kernels as unknown_ops, recorder:
            with _lifetimes_tracked(eager_lifetimes), constant_item():
                custom_step(state, marker, on_step)
            eager_lifetimes.finish()
    except MemplanError:
        raise
    except Exception as error:
        raise _trace_failure(error, tracker.current(), spec, state.batch) from error
    finally:
        for finalizer in finalizers:  # gradients the step keeps must not keep this recorder alive
            finalizer.detach()
    left = current_grads(state)
    graph = recorder.finish(left)
    categories, sizes = _categorize(state, left)
    for key, nbytes in seen:
        categories[key], sizes[key] = "gradients", nbytes
    released_early = []
    for key, nbytes in previous_grads:
        if key in freed_at:
            categories[key] = "gradients"
            released_early.append((key, nbytes, max(freed_at[key] - 1, 0)))
    stored = (categories, sizes)
    return _traced_step(
        graph, settings, state, boundaries, stored, tracker, eager_lifetimes, started, None, unknown_ops, released_early
    )


@contextlib.contextmanager
def _lifetimes_tracked(eager_lifetimes: _EagerLifetimes) -> Iterator[None]:
    """How long Python, the autocast cache, checkpoint inputs and autograd Functions' contexts keep each
    tensor, while the step runs."""
    with eager_lifetimes, python_holders_tracked(eager_lifetimes):
        yield


def _traced_step(
    graph: OpGraph,
    settings: TrainingSettings,
    state: TrainingState,
    boundaries: dict[str, int],
    stored: tuple[dict[StorageWeakRef, str], dict[StorageWeakRef, int]],
    tracker: _ModuleTracker,
    eager_lifetimes: _EagerLifetimes,
    started: float,
    recording: OptimizerRecording | None,
    unknown_ops: set[str],
    released_early: list[tuple[StorageWeakRef, int, int]],
) -> TracedStep:
    """The TracedStep of a finished recording: phases from `boundaries` (the whole graph where a
    phase never ended), storages from `stored` (categories, sizes)."""
    node_count = len(graph.nodes)
    return TracedStep(
        graph=graph,
        settings=settings,
        forward_end=boundaries.get("forward", node_count),
        backward_end=boundaries.get("backward", node_count),
        storage_categories=stored[0],
        storage_bytes=stored[1],
        node_modules=tracker.per_node(node_count),
        parameter_count=sum(logical_numel(p) for p in state.model.parameters()),
        trainable_parameter_count=sum(p.numel() for p in state.trainable),
        checkpointed_blocks=state.checkpointed_blocks,
        python_lifetimes=eager_lifetimes.local_lifetimes,
        backward_node_ops=eager_lifetimes.backward_node_ops,
        seconds=time.perf_counter() - started,
        optimizer_recording=recording,
        unknown_target_ops=tuple(sorted(unknown_ops)),
        released_early=tuple(released_early),
    )


def _note_when_freed(
    tensors: list[torch.Tensor], freed_at: dict[StorageWeakRef, int], node_count: Callable[[], int]
) -> list[weakref.finalize]:
    """Record in `freed_at` the node count at which each tensor is freed (a function of its own, so
    no loop variable outlives the loop and keeps the last one alive); the finalizers, to detach
    once the recording ends."""
    finalizers = []
    for tensor in tensors:
        key = storage_key(tensor)
        finalizers.append(weakref.finalize(tensor, lambda key=key: freed_at.setdefault(key, node_count())))
    return finalizers


def _categorize(
    state: TrainingState, grads: list[torch.Tensor]
) -> tuple[dict[StorageWeakRef, str], dict[StorageWeakRef, int]]:
    categories: dict[StorageWeakRef, str] = {}
    sizes: dict[StorageWeakRef, int] = {}
    groups = {
        "communication": communication_tensors(state),
        "inputs": tensors_in(state.batch),
        "optimizer_state": optimizer_tensors(state),
        "gradients": grads,
        "parameters": model_tensors(state),
    }
    for category, tensors in groups.items():
        for tensor in tensors:
            key = storage_key(tensor)
            categories[key] = category
            sizes[key] = tensor.untyped_storage().nbytes()
    return categories, sizes


def _trace_failure(error: Exception, module: str | None, spec: ModelSpec, batch: object = None) -> TraceError:
    where = f"in module {module}" if module else "outside any module (loss or optimizer)"
    op = getattr(error, "func", None)
    if isinstance(error, DataDependentOutputException | DynamicOutputShapeException):
        return TraceError(
            f"cannot trace {spec.name}: op {op} {where} depends on tensor values "
            "(data-dependent control flow, .item() or a data-dependent shape); "
            "make that code shape-only or pass a model without it"
        )
    if isinstance(error, UnsupportedOperatorException):
        return TraceError(
            f"cannot trace {spec.name}: op {op} {where} has no fake-tensor implementation; "
            "memplan cannot predict its memory (report it with --debug output)"
        )
    hint = ""
    if module and spec.ref.inputs is not None:  # the user's own batch may not be what the model takes
        hint = f"; check that the batch from --inputs {spec.ref.inputs} ({_describe_batch(batch)}) is what it takes"
    return TraceError(
        f"cannot trace {spec.name} {where}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        f"{hint}; rerun with --debug for the traceback"
    )


def _describe_batch(batch: object) -> str:
    """Shapes and dtypes of a batch, short: `tensor (2, 11) float32`, `x: tensor (2, 8) int64`."""

    def one(value: object) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__

    if isinstance(batch, dict):
        return ", ".join(f"{key}: {one(value)}" for key, value in batch.items())
    if isinstance(batch, tuple | list):
        return ", ".join(one(value) for value in batch)
    return one(batch)


@contextlib.contextmanager
def _target_kernels(settings: TrainingSettings) -> Iterator[set[str]]:
    """On a cuda target, CUDA's autocast lists, attention backends and dropout kernel, and
    bitsandbytes' 8-bit matmul as it runs there.

    Yields the set of ops that ran whose CUDA behaviour memplan does not know (reported, not guessed).
    """
    if settings.device != "cuda":
        yield set()
        return
    with (
        cuda_autocast_policy() as unknown_autocast_ops,
        cuda_kernels(settings.gpu, settings.deterministic),
        int8_matmul_as_on_cuda(),
    ):
        yield unknown_autocast_ops


@dataclass
class FakeSetup:
    """A model, optimizer and state built once under fake tensors, reusable across batch sizes."""

    fake_mode: FakeTensorMode
    state: TrainingState


def build_fake_setup(spec: ModelSpec, settings: TrainingSettings) -> FakeSetup:
    fake_mode = TracingFakeMode(allow_non_fake_inputs=True)
    with fake_mode, constant_item(), no_weight_init(), fake_friendly_conversions():
        state = prepare(spec, settings)
        if settings.step is None and state.data_parallel is None:
            _warm_up_optimizer(state)
    if settings.step is not None or state.data_parallel is not None:
        # One untraced iteration leaves the state a steady-state one finds: whatever the user's own
        # step leaves; under DDP, the optimizer's state and the order the gradients became ready,
        # in which the second iteration's forward makes the buckets again.
        try:
            with fake_mode, real_run_paths(), _target_kernels(settings), constant_item():
                iteration(state)  # the user's step, where there is one
                if state.data_parallel is not None:
                    # Now, not at the traced step's first forward: that would trace the old buckets
                    # freed and the new ones made (where the warm-up ran one forward, it has not yet).
                    state.data_parallel.rebuild_buckets()
        except MemplanError:
            raise
        except Exception as error:
            if settings.step is not None:
                raise _step_failure(error, settings) from error
            raise _trace_failure(error, None, spec, state.batch) from error
    return FakeSetup(fake_mode=fake_mode, state=state)


def _gradients_as_ddp_makes_them(state: TrainingState, settings: TrainingSettings, fake_mode: FakeTensorMode) -> None:
    """The gradients a DDP rank's last micro-batch (or a loop that keeps them) finds, made as DDP makes
    them: with gradient_as_bucket_view they are views into its buckets, not tensors of their own. What
    the warm-up left is kept; where the loop dropped them, one untraced micro-batch makes them."""
    if all(param.grad is not None for param in state.trainable):
        return
    state.micro_batches_done = max(settings.grad_accum - 2, 0)
    with fake_mode, real_run_paths(), _target_kernels(settings), constant_item():
        micro_batch(state)
    state.micro_batches_done = settings.grad_accum - 1


def _step_failure(error: Exception, settings: TrainingSettings) -> TraceError:
    return TraceError(
        f"--step {settings.step} failed under fake tensors ({type(error).__name__}: {error}); it is called as "
        "fn(model, batch, optimizer) and must run on tensors without values (no data-dependent Python control "
        "flow); use --debug for the traceback"
    )


def trace_step(
    spec: ModelSpec,
    settings: TrainingSettings,
    setup: FakeSetup | None = None,
    optimizer_replay: OptimizerRecording | None = None,
) -> TracedStep:
    """Trace the last micro-batch (gradients already present when grad_accum > 1) and the optimizer step.

    `setup` (from `build_fake_setup` with the same settings but any batch size) skips rebuilding the model.
    `optimizer_replay`: an earlier trace's `optimizer_recording` on the same setup, replayed instead of
    tracing the optimizer step again when the new gradients match it (memplan.estimator.replay).
    """
    started = time.perf_counter()
    setup = setup or build_fake_setup(spec, settings)
    fake_mode, state = setup.fake_mode, setup.state
    state.settings = settings
    with fake_mode:
        state.batch = spec.make_batch(settings, STORAGE_DTYPES[settings.precision])
        state.micro_batches_done = settings.grad_accum - 1  # the step's last micro-batch is traced
        if gradients_outlive_the_step(settings) and state.data_parallel is None:
            # Later micro-batches find every gradient allocated (they dominate the first one), and
            # so do loops that free them late or never (memplan.estimator.loop).
            for param in state.trainable:
                param.grad = torch.zeros_like(param)
    if gradients_outlive_the_step(settings) and state.data_parallel is not None:
        _gradients_as_ddp_makes_them(state, settings, fake_mode)
    previous_grads = [(storage_key(grad), grad.untyped_storage().nbytes()) for grad in current_grads(state)]
    inputs = tensors_in(state.batch)
    boundaries: dict[str, int] = {}
    recorder = GraphRecorder(inputs)
    if settings.step is not None:
        return _trace_custom_step(spec, settings, state, fake_mode, recorder, previous_grads, started)

    def marker(phase: str) -> None:
        boundaries[phase] = recorder.node_count()

    eager_lifetimes = _EagerLifetimes(recorder.node_count)
    tracker = _ModuleTracker(state.built_model, recorder.node_count)
    try:
        # Autocast's weight-cast cache stays on, as in the real run: _EagerLifetimes records how
        # long it holds each copy (make_fx, which memplan traced with before, turned it off).
        target_kernels = _target_kernels(settings)
        with fake_mode, tracker, real_run_paths(), target_kernels as unknown_ops, recorder:
            with _lifetimes_tracked(eager_lifetimes):
                micro_batch(state, marker)
            eager_lifetimes.finish()
            grads = current_grads(state)
            step_start = recorder.node_count()
            if optimizer_replay is not None and optimizer_replay.matches(grads):
                recorder.replay(optimizer_replay, grads)
                drop_grads(state)
                recording: OptimizerRecording | None = optimizer_replay
                eager_lifetimes.local_lifetimes += optimizer_replay.local_lifetimes_from(step_start)
            else:
                recorder.recording = OptimizerRecording(grads)
                optimizer_locals = OptimizerLocals(recorder.node_count)
                with constant_item(), optimizer_locals:
                    optimizer_step(state)  # gradients live until zero_grad ends the iteration
                optimizer_locals.finish()
                recording, recorder.recording = recorder.recording, None
                recording.keep_local_lifetimes(optimizer_locals.lifetimes, step_start)
                eager_lifetimes.local_lifetimes += recording.local_lifetimes_from(step_start)
                # What outlives one trace of the fake model, besides the gradients.
                if not recording.is_replayable(model_tensors(state) + optimizer_tensors(state)):
                    recording = None
    except MemplanError:
        raise
    except Exception as error:  # any failure inside the user's model becomes one clear message
        raise _trace_failure(error, tracker.current(), spec, state.batch) from error
    graph = recorder.finish(grads)
    categories, sizes = _categorize(state, grads)
    released_early = []
    if "zero_grad" in boundaries:  # the previous gradients were dropped after the forward
        for key, nbytes in previous_grads:
            categories[key] = "gradients"
            released_early.append((key, nbytes, boundaries["zero_grad"] - 1))
    stored = (categories, sizes)
    return _traced_step(
        graph,
        settings,
        state,
        boundaries,
        stored,
        tracker,
        eager_lifetimes,
        started,
        recording,
        unknown_ops,
        released_early,
    )
