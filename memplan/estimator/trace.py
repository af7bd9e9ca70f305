"""Capture one steady-state iteration as an FX graph over fake tensors (design.md §3).

The step is traced *statefully*: the model's own fake parameters, `.backward()` through the autograd
engine, then the real `torch.optim` optimizer. Parameters, buffers, optimizer state and existing
gradients become graph constants; the batch becomes the graph's placeholders.
"""

from __future__ import annotations

import contextlib
import re
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.distributed.fsdp import StorageResize, sharding_categories, storage_resizes_recorded
from memplan.distributed.offload import HostMemory, copies_made
from memplan.errors import MemplanError, SettingsError, TraceError
from memplan.estimator.cuda.autocast import cuda_autocast_policy
from memplan.estimator.cuda.kernels import cuda_kernels
from memplan.estimator.eager_lifetimes import EagerLifetimes, lifetimes_tracked, storage_key
from memplan.estimator.fake_conversions import fake_friendly_conversions
from memplan.estimator.fake_mode import TracingFakeMode
from memplan.estimator.held_tensors import OptimizerLocals
from memplan.estimator.hf_patches import no_weight_init, real_run_paths
from memplan.estimator.leaves import local_tensor, tensors_in
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
from memplan.estimator.module_tracker import ModuleTracker
from memplan.estimator.opgraph import OpGraph
from memplan.estimator.recorder import GraphRecorder
from memplan.estimator.replay import OptimizerRecording
from memplan.estimator.swapped_storages import SwappedStorages, parameter_data_swaps, storages_held_by_fake_tensors
from memplan.finetune.bnb_kernels import int8_matmul_as_on_cuda
from memplan.finetune.quantize import logical_numel
from memplan.interrupts import deferred
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
    # --parallel fsdp: FSDP2's unsharded parameter storages, allocated and freed by resizing, in order.
    storage_resizes: tuple[StorageResize, ...] = ()
    # --parallel zero2/zero3: the storages DeepSpeed swapped under parameters (memplan.estimator.swapped_storages).
    swapped_storages: SwappedStorages | None = None
    # --offload params or optimizer: the rank's host memory, out of the device's figures (memplan.distributed.offload).
    host_memory: HostMemory | None = None
    # Graph nodes: weights a backward formula cast into the autocast cache, which the cache holds (python_lifetimes)
    # and the autograd engine does not (no extension to the formula's end).
    formula_casts: frozenset[int] = frozenset()


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
        seen.extend((storage_key(grad), local_tensor(grad).untyped_storage().nbytes()) for grad in grads)

    eager_lifetimes = EagerLifetimes(recorder.node_count)
    tracker = ModuleTracker(state.built_model, recorder.node_count)
    try:
        target_kernels = _target_kernels(settings)
        resizes_recorded = storage_resizes_recorded(recorder.node_count, state.data_parallel, recorder.stream_numbers)
        with fake_mode, tracker, real_run_paths(), target_kernels as unknown_ops, recorder, resizes_recorded as resizes:
            with lifetimes_tracked(eager_lifetimes), constant_item():
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
    observed = _Observed(tracker, eager_lifetimes, started, unknown_ops, resizes)
    return _traced_step(graph, state, boundaries, (categories, sizes), observed, None, released_early)


@dataclass
class _Observed:
    """What watched a recording besides the recorder, as it left it."""

    tracker: ModuleTracker  # which module ran each op
    eager_lifetimes: EagerLifetimes
    started: float  # perf_counter when the trace began
    unknown_ops: set[str]  # ran with a target behaviour memplan does not know
    resizes: list[StorageResize]  # FSDP2's
    swapped: SwappedStorages | None = None  # where a library swaps storages under parameters
    host: HostMemory | None = None  # --offload: the rank's host memory


def _traced_step(
    graph: OpGraph,
    state: TrainingState,
    boundaries: dict[str, int],
    stored: tuple[dict[StorageWeakRef, str], dict[StorageWeakRef, int]],
    observed: _Observed,
    recording: OptimizerRecording | None,
    released_early: list[tuple[StorageWeakRef, int, int]],
) -> TracedStep:
    """The TracedStep of a finished recording: phases from `boundaries` (the whole graph where a
    phase never ended), storages from `stored` (categories, sizes)."""
    node_count = len(graph.nodes)
    for key, category in sharding_categories(graph, observed.resizes).items():
        stored[0].setdefault(key, category)
    return TracedStep(
        graph=graph,
        settings=state.settings,
        forward_end=boundaries.get("forward", node_count),
        backward_end=boundaries.get("backward", node_count),
        storage_categories=stored[0],
        storage_bytes=stored[1],
        node_modules=observed.tracker.per_node(node_count),
        parameter_count=sum(_weights(p) for p in state.model.parameters()),
        trainable_parameter_count=sum(_weights(p) for p in state.trainable),
        checkpointed_blocks=state.checkpointed_blocks,
        python_lifetimes=observed.eager_lifetimes.local_lifetimes,
        backward_node_ops=observed.eager_lifetimes.backward_node_ops,
        formula_casts=frozenset(observed.eager_lifetimes.formula_casts),
        seconds=time.perf_counter() - observed.started,
        optimizer_recording=recording,
        unknown_target_ops=tuple(sorted(observed.unknown_ops)),
        released_early=tuple(released_early),
        storage_resizes=tuple(observed.resizes),
        swapped_storages=observed.swapped,
        host_memory=observed.host,
    )


def _weights(param: torch.Tensor) -> int:
    """The weights a parameter stands for: a 4-bit layer's packed bytes hold two each, and a ZeRO-3
    parameter, an empty tensor between uses, keeps its full size as `ds_numel` (partition_parameters.py)."""
    full = getattr(param, "ds_numel", None)
    return int(full) if full is not None else logical_numel(param)


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
            sizes[key] = local_tensor(tensor).untyped_storage().nbytes()
    # What a data-parallel wrapper made and let go inside the step (DeepSpeed's buckets and gradients).
    for key, nbytes, category in getattr(state.data_parallel, "noted_storages", list)():
        categories.setdefault(key, category)
        sizes.setdefault(key, nbytes)
    return categories, sizes


# transformers' ViT-family embeddings refuse an image of another size than the config's unless asked to
# interpolate their position embeddings (modeling_vit.py, ViTEmbeddings / ViTPatchEmbeddings)
_IMAGE_SIZE_REFUSED = re.compile(r"Input image size \((\d+)\*(\d+)\) doesn't match model \((\d+)\*(\d+)\)")


def _trace_failure(
    error: Exception, module: str | None, spec: ModelSpec, batch: object = None
) -> TraceError | SettingsError:
    refused = _IMAGE_SIZE_REFUSED.search(str(error))
    if refused is not None and spec.ref.inputs is None:  # memplan made the batch: the user's --image-size it was
        size, height, width = refused.group(1), refused.group(3), refused.group(4)
        square = f"; give --image-size {height} or leave it out" if height == width else ""
        return SettingsError(
            f"--image-size {size}: {spec.name} takes {height}×{width} images (its position embeddings are sized "
            f"for them){square}"
        )
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


@deferred()
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
            offload_copies = copies_made(state.data_parallel)
            with fake_mode, real_run_paths(), _target_kernels(settings), constant_item(), offload_copies:
                iteration(state)  # the user's step, where there is one
                if state.data_parallel is not None:
                    # Now, not at the traced step's first forward: that would trace the old buckets
                    # freed and the new ones made (where the warm-up ran one forward, it has not yet).
                    state.data_parallel.after_warm_up()
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
    the warm-up left is kept; where the loop dropped them, one untraced micro-batch makes them.
    DeepSpeed's engine keeps a step's gradients in its own partition, not in `.grad`, and counts the
    micro-batches itself: it always runs the untraced one, and is told the traced one is the step's last."""
    engine_counts = hasattr(state.data_parallel, "after_micro_batch") and settings.grad_accum > 1
    if not engine_counts and all(param.grad is not None for param in state.trainable):
        return
    state.micro_batches_done = max(settings.grad_accum - 2, 0)
    with fake_mode, real_run_paths(), _target_kernels(settings), constant_item(), copies_made(state.data_parallel):
        micro_batch(state)
        if engine_counts:
            state.data_parallel.after_micro_batch()
            state.data_parallel.skip_micro_batches(settings.grad_accum - 2)
    state.micro_batches_done = settings.grad_accum - 1


def _step_failure(error: Exception, settings: TrainingSettings) -> TraceError:
    return TraceError(
        f"--step {settings.step} failed under fake tensors ({type(error).__name__}: {error}); it is called as "
        "fn(model, batch, optimizer) and must run on tensors without values (no data-dependent Python control "
        "flow); use --debug for the traceback"
    )


@deferred()
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
    previous_grads = [
        (storage_key(grad), local_tensor(grad).untyped_storage().nbytes()) for grad in current_grads(state)
    ]
    inputs = tensors_in(state.batch)
    boundaries: dict[str, int] = {}
    recorder = GraphRecorder(inputs)
    if getattr(state.data_parallel, "swaps_storages", False):
        recorder.producers = {}
    if hasattr(state.data_parallel, "before_traced_iteration"):
        state.data_parallel.before_traced_iteration(recorder.node_count)
    if settings.step is not None:
        return _trace_custom_step(spec, settings, state, fake_mode, recorder, previous_grads, started)

    def marker(phase: str) -> None:
        boundaries[phase] = recorder.node_count()

    eager_lifetimes = EagerLifetimes(recorder.node_count)
    tracker = ModuleTracker(state.built_model, recorder.node_count)
    try:
        # Autocast's weight-cast cache stays on, as in the real run: EagerLifetimes records how
        # long it holds each copy (make_fx, which memplan traced with before, turned it off).
        target_kernels = _target_kernels(settings)
        resizes_recorded = storage_resizes_recorded(recorder.node_count, state.data_parallel, recorder.stream_numbers)
        swapping = recorder.producers is not None
        swaps = parameter_data_swaps(recorder.node_count) if swapping else contextlib.nullcontext()
        with (
            fake_mode,
            tracker,
            real_run_paths(),
            target_kernels as unknown_ops,
            recorder,
            resizes_recorded as resizes,
            swaps as swaps_seen,
            copies_made(state.data_parallel) as host_copies,
        ):
            with lifetimes_tracked(eager_lifetimes):
                micro_batch(state, marker)
            eager_lifetimes.finish()
            grads = current_grads(state)
            step_start = recorder.node_count()
            # No module runs in the step. A module whose forward a checkpoint's recomputation stopped
            # early (torch.utils.checkpoint stops once it has what the backward needs) never ran its
            # forward hook, and would otherwise be named as where the step's peak falls.
            tracker.stack.clear()
            tracker.transitions.append((step_start, None))
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
                if not recording.is_replayable(model_tensors(state) + optimizer_tensors(state)) or resizes:
                    recording = None  # FSDP2's step runs on local shards a replay cannot substitute
            if swaps_seen is not None:
                # DeepSpeed's step swaps storages too (stage 3 partitions and gathers parameters):
                # watched through it, and never replayed (the recording's tensors would count as held).
                recording = None
    except MemplanError:
        raise
    except Exception as error:  # any failure inside the user's model becomes one clear message
        raise _trace_failure(error, tracker.current(), spec, state.batch) from error
    held_at_end = storages_held_by_fake_tensors() if swaps_seen is not None else None
    graph = recorder.finish(grads)
    categories, sizes = _categorize(state, grads)
    released_early = []
    if "zero_grad" in boundaries:  # the previous gradients were dropped after the forward
        for key, nbytes in previous_grads:
            categories[key] = "gradients"
            released_early.append((key, nbytes, boundaries["zero_grad"] - 1))
    dropped = getattr(state.data_parallel, "dropped_in_step", frozenset)()
    swapped = None if swaps_seen is None else SwappedStorages(swaps_seen, held_at_end or frozenset(), dropped)
    for key in swaps_seen.entered.values() if swaps_seen is not None else ():
        if categories.get(key, "parameters") == "parameters":  # ZeRO-3's gathered parameters, whole
            categories[key] = "unsharded_parameters"
    observed = _Observed(tracker, eager_lifetimes, started, unknown_ops, resizes, swapped)
    if getattr(state.data_parallel, "offload", False):
        rank = state.data_parallel
        optimizer_state = [local_tensor(tensor) for tensor in optimizer_tensors(state)]
        gradients = [local_tensor(grad) for grad in grads]
        observed.host = rank.host_memory(gradients, optimizer_state, host_copies)
    return _traced_step(graph, state, boundaries, (categories, sizes), observed, recording, released_early)
