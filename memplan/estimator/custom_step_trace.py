"""Tracing `--step`: the user's own whole iteration, recorded as it runs (memplan.estimator.loop.custom_step)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from memplan.distributed.fsdp import storage_resizes_recorded
from memplan.errors import MemplanError
from memplan.estimator.cuda.target import target_kernels
from memplan.estimator.eager_lifetimes import EagerLifetimes, lifetimes_tracked, storage_key
from memplan.estimator.fake_mode import constant_item
from memplan.estimator.held_tensors import OptimizerLocals
from memplan.estimator.hf_patches import real_run_paths
from memplan.estimator.leaves import local_tensor
from memplan.estimator.loop import TrainingState, current_grads, custom_step
from memplan.estimator.module_attributes import attribute_tensors
from memplan.estimator.module_tracker import ModuleTracker
from memplan.estimator.optimizers import optimizer_state_tensors
from memplan.estimator.recorder import GraphRecorder
from memplan.estimator.saved_tensors import SavedTensors
from memplan.estimator.trace_errors import trace_failure
from memplan.estimator.traced_step import Observed, TracedStep, categorize_storages, traced_step_from
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

    eager_lifetimes = EagerLifetimes(recorder.node_count)
    tracker = ModuleTracker(state.built_model, recorder.node_count)
    graphs = SavedTensors(recorder.node_count)
    step_hook = register_optimizer_step_post_hook(after_step)
    try:
        on_target = target_kernels(settings)
        resizes_recorded = storage_resizes_recorded(recorder.node_count, state.data_parallel, recorder.stream_numbers)
        with (
            fake_mode,
            tracker,
            real_run_paths(recorder.tensor_nodes),
            on_target as unknown_ops,
            recorder,
            resizes_recorded as resizes,
        ):
            # How long the step's optimizers keep their temporaries in locals, as in memplan's own step (trace.py).
            optimizer_locals = OptimizerLocals(recorder.node_count)
            with lifetimes_tracked(eager_lifetimes), constant_item(), graphs, optimizer_locals.watch_steps():
                custom_step(state, marker, on_step)
            eager_lifetimes.finish()
            held_in_locals = optimizer_locals.lifetimes
            eager_lifetimes.local_lifetimes += [(storage_key(tensor), end) for tensor, end in held_in_locals]
            held_in_locals.clear()
            # What the model keeps on its modules lives through the step (memplan.estimator.module_attributes).
            step_end = recorder.node_count() - 1
            eager_lifetimes.local_lifetimes += [
                (storage_key(tensor), step_end) for tensor in attribute_tensors(state.built_model)
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
    observed = Observed(tracker, eager_lifetimes, started, unknown_ops, resizes)
    return traced_step_from(graph, state, boundaries, (categories, sizes), observed, None, released_early)


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
