"""Tracing `--step`: the user's own whole iteration, recorded as it runs (memplan.estimator.user_step.custom_step)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from memplan.distributed.fsdp import storage_resizes_recorded
from memplan.errors import MemplanError
from memplan.estimator.cuda.host_tensors import host_outputs_recorded, optimizer_host_tensors
from memplan.estimator.cuda.target import target_kernels
from memplan.estimator.eager_lifetimes import EagerLifetimes, lifetimes_tracked, storage_key
from memplan.estimator.fake_mode import constant_item
from memplan.estimator.held_tensors import OptimizerLocals
from memplan.estimator.hf_patches import real_run_paths
from memplan.estimator.leaves import local_tensor
from memplan.estimator.loop import (
    TrainingState,
    current_grads,
    input_tensors,
    model_tensors,
    optimizer_tensors,
)
from memplan.estimator.module_attributes import attribute_tensors
from memplan.estimator.module_tracker import ModuleTracker
from memplan.estimator.optimizers import optimizer_state_tensors
from memplan.estimator.recorder import GraphRecorder
from memplan.estimator.rng_snapshots import rng_snapshots_recorded
from memplan.estimator.saved_tensors import SavedTensors
from memplan.estimator.swapped_storages import tensors_python_holds
from memplan.estimator.tensor_caches import cached_tensors
from memplan.estimator.trace_errors import trace_failure
from memplan.estimator.traced_step import Observed, TracedStep, categorize_storages, traced_step_from
from memplan.estimator.user_step import custom_step
from memplan.estimator.wrapped_numbers import wrapped_numbers_recorded
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings


def trace_custom_step(
    spec: ModelSpec,
    settings: TrainingSettings,
    state: TrainingState,
    fake_mode: FakeTensorMode,
    recorder: GraphRecorder,
    previous_grads: list[tuple[StorageWeakRef, int]],
    started: float,
    keeps_tensors: bool = True,
) -> TracedStep:
    """trace_step for `--step`: the user's whole iteration, recorded as it runs. `keeps_tensors`: whether the step's
    last call left tensors of its own alive (keeps_tensors_across_calls; where not, none is looked for again).

    Gradients the iteration starts with (what the step left last time) that it frees count until
    the op where they went; the gradients its optimizer step finds are gradients; those it leaves
    allocated outlive the iteration."""
    boundaries: dict[str, int] = {}
    freed_at: dict[StorageWeakRef, int] = {}
    finalizers = _note_when_freed(current_grads(state), freed_at, recorder.node_count)  # holding none of them
    # What the step kept from its last call (an output with its graph on the model, a list in a global): alive as
    # the call starts, until the step lets it go.
    kept, kept_freed_at = (
        _kept_from_the_last_call(state, fake_mode, recorder.node_count, finalizers) if keeps_tensors else ([], {})
    )
    seen: list[tuple[StorageWeakRef, int]] = []

    def marker(phase: str) -> None:
        boundaries[phase] = recorder.node_count()

    own_optimizers: list[Any] = []  # optimizers the step made itself, whose state is optimizer state

    def on_step(grads: list[torch.Tensor], optimizer: Any) -> None:
        seen.extend((storage_key(grad), local_tensor(grad).untyped_storage().nbytes()) for grad in grads)
        # `.grad` holds them until the step's zero_grad (or the next backward) lets go, past the
        # optimizer's last read of them: watched like the previous gradients.
        finalizers.extend(_note_when_freed(grads, freed_at, recorder.node_count))
        if optimizer is not None and optimizer is not state.optimizer:
            own_optimizers.append(optimizer)

    # Optimizer state the step's optimizers hold after each of their steps (state made in the step: an optimizer
    # the step makes anew, state it cleared) lives until they drop it, not to its last read.
    state_held: set[StorageWeakRef] = set()

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        made = [tensor for tensor in optimizer_state_tensors(optimizer) if storage_key(tensor) not in state_held]
        state_held.update(storage_key(tensor) for tensor in made)
        finalizers.extend(_note_when_freed(made, freed_at, recorder.node_count))

    eager_lifetimes = EagerLifetimes(recorder.node_count, recorder.aliases_of, recorder.target)
    tracker = ModuleTracker(state.built_model, recorder.node_count)
    graphs = SavedTensors(recorder.node_count)
    step_hook = register_optimizer_step_post_hook(after_step)
    try:
        on_target = target_kernels(settings)
        resizes_recorded = storage_resizes_recorded(recorder.node_count, state.data_parallel, recorder.stream_numbers)
        with (
            fake_mode,
            tracker,
            real_run_paths(recorder.tensor_nodes, recorder.graph.nodes),
            on_target as unknown_ops,
            recorder,
            resizes_recorded as resizes,
            rng_snapshots_recorded(recorder.node_count, settings.device) as rng_snapshots,
            wrapped_numbers_recorded(recorder.node_count, settings.device, recorder) as wrapped_numbers,
            host_outputs_recorded() as host_outputs,
        ):
            # How long the step's optimizers keep their temporaries in locals, as in memplan's own step (trace.py).
            optimizer_locals = OptimizerLocals(recorder.node_count, storage_key)
            with lifetimes_tracked(eager_lifetimes), constant_item(), graphs, optimizer_locals.watch_steps():
                custom_step(state, marker, on_step)
            eager_lifetimes.finish()
            eager_lifetimes.local_lifetimes += optimizer_locals.lifetimes
            # What the model keeps on its modules lives through the step (memplan.estimator.module_attributes).
            step_end = recorder.node_count() - 1
            eager_lifetimes.local_lifetimes += [
                (storage_key(tensor), step_end) for tensor in [*attribute_tensors(state.built_model), *cached_tensors()]
            ]
            eager_lifetimes.local_lifetimes += graphs.lifetimes(step_end)
            eager_lifetimes.local_lifetimes += [
                (key, max(freed_at[key] - 1, 0) if key in freed_at else step_end) for key in state_held
            ]
    except MemplanError:
        raise
    except Exception as error:
        raise trace_failure(error, tracker.current(), spec, state.batch) from error
    finally:
        step_hook.remove()
        for finalizer in finalizers:  # gradients the step keeps must not keep this recorder alive
            finalizer.detach()
    left = current_grads(state)
    graph = recorder.finish(left)
    categories, sizes = categorize_storages(state, left)
    for optimizer in own_optimizers:
        for tensor in optimizer_state_tensors(optimizer):
            key = storage_key(tensor)
            categories[key], sizes[key] = "optimizer_state", local_tensor(tensor).untyped_storage().nbytes()
    on_host = [
        *host_outputs,
        *(tensor for optimizer in [state.optimizer, *own_optimizers] for tensor in optimizer_host_tensors(optimizer)),
    ]
    own_optimizers.clear()  # nothing of the step's own is kept past the trace
    for key, nbytes in seen:
        categories[key], sizes[key] = "gradients", nbytes
        if key in freed_at:
            eager_lifetimes.local_lifetimes.append((key, max(freed_at[key] - 1, 0)))
    released_early = []
    for key, nbytes in previous_grads:
        if key in freed_at:
            categories[key] = "gradients"
            released_early.append((key, nbytes, max(freed_at[key] - 1, 0)))
    last_node = len(graph.nodes) - 1
    for key, nbytes in kept:
        end = max(kept_freed_at[key] - 1, 0) if key in kept_freed_at else last_node
        released_early.append((key, nbytes, end))
    observed = Observed(
        tracker,
        eager_lifetimes,
        started,
        unknown_ops,
        resizes,
        rng_snapshots=rng_snapshots,
        wrapped_numbers=wrapped_numbers,
    )
    if settings.device == "cuda":  # what a GPU run keeps in host memory (memplan.estimator.cuda.host_tensors)
        observed.host_tensors = frozenset(storage_key(tensor) for tensor in on_host)
    return traced_step_from(graph, state, boundaries, (categories, sizes), observed, None, released_early)


def _kept_by_storage(state: TrainingState, fake_mode: FakeTensorMode) -> dict[StorageWeakRef, list[torch.Tensor]]:
    """The tensors of this trace's fake mode that Python holds, by storage, besides the model's, the optimizer's, the
    batch's and the gradients: what the step's last call kept (its own optimizers' state too)."""
    known = {
        storage_key(tensor)
        for tensor in (*model_tensors(state), *optimizer_tensors(state), *input_tensors(state), *current_grads(state))
    }
    by_storage: dict[StorageWeakRef, list[torch.Tensor]] = {}
    for tensor in tensors_python_holds(FakeTensor):
        if tensor.fake_mode is fake_mode and (key := storage_key(tensor)) not in known:
            by_storage.setdefault(key, []).append(tensor)
    return by_storage


def keeps_tensors_across_calls(state: TrainingState, fake_mode: FakeTensorMode) -> bool:
    """Whether the step's last call left tensors of its own alive (memplan.estimator.trace then calls it once more,
    untraced, with the batch about to be traced: what it keeps is of that batch's size, as in a real loop)."""
    return bool(_kept_by_storage(state, fake_mode))


def _kept_from_the_last_call(
    state: TrainingState,
    fake_mode: FakeTensorMode,
    node_count: Callable[[], int],
    finalizers: list[weakref.finalize],
) -> tuple[list[tuple[StorageWeakRef, int]], dict[StorageWeakRef, int]]:
    """The storages the step's last call kept (_kept_by_storage), alive as the traced call starts, each with its
    bytes; and, filled in as the call runs, the node count at which the last tensor of each was freed (finalizers
    added to `finalizers`). Holds none of them."""
    by_storage = _kept_by_storage(state, fake_mode)
    freed_at: dict[StorageWeakRef, int] = {}
    kept = []
    for key, tensors in by_storage.items():
        kept.append((key, local_tensor(tensors[0]).untyped_storage().nbytes()))
        finalizers.extend(_note_when_all_freed(key, tensors, freed_at, node_count))
    return kept, freed_at


def _note_when_all_freed(
    key: StorageWeakRef, tensors: list[torch.Tensor], freed_at: dict[StorageWeakRef, int], node_count: Callable[[], int]
) -> list[weakref.finalize]:
    """Record in `freed_at[key]` the node count at which the last of `tensors` (views of one storage) is freed."""
    alive = [len(tensors)]

    def one_freed() -> None:
        alive[0] -= 1
        if alive[0] == 0:
            freed_at.setdefault(key, node_count())

    return [weakref.finalize(tensor, one_freed) for tensor in tensors]


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
