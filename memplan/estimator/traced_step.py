"""What a trace leaves: the step's graph and what memplan knows about its storages and phases.

memplan.estimator.trace records it; memplan.estimator.custom_step_trace records a user's `--step`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.distributed.fsdp import StorageResize, sharding_categories
from memplan.distributed.offload import HostMemory
from memplan.estimator.eager_lifetimes import EagerLifetimes, storage_key
from memplan.estimator.leaves import local_tensor
from memplan.estimator.loop import (
    TrainingState,
    communication_tensors,
    input_tensors,
    model_tensors,
    optimizer_tensors,
)
from memplan.estimator.module_tracker import ModuleTracker
from memplan.estimator.opgraph import OpGraph
from memplan.estimator.replay import OptimizerRecording
from memplan.estimator.swapped_storages import SwappedStorages
from memplan.finetune.quantize import logical_numel
from memplan.settings import TrainingSettings


@dataclass(frozen=True)
class PreviousMicroBatch:
    """A copy of `storage` that the previous micro-batch's loss or output holds (itself, or its graph's): the loop's
    variable keeps it alive until the traced micro-batch's forward binds it again (memplan.estimator.loop,
    TrainingState.kept_loss, kept_output)."""

    storage: object  # a StorageWeakRef, or an RngSnapshot (memplan.estimator.rng_snapshots)


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
    # cuda target: what a GPU run keeps in host memory besides (memplan.estimator.cuda.host_tensors): step counters,
    # attention's philox seeds; out of the device's figures as host_memory's are.
    host_tensors: frozenset[StorageWeakRef] = frozenset()
    # Graph nodes: weights a backward formula cast into the autocast cache, which the cache holds (python_lifetimes)
    # and the autograd engine does not (no extension to the formula's end).
    formula_casts: frozenset[int] = frozenset()
    # For each of backward_node_ops, the storages its Node returned (None: not seen); formula_blocks.formula_blocks
    formula_results: tuple[frozenset[StorageWeakRef] | None, ...] = ()
    # For each of backward_node_ops, whether its Node is a Python autograd Function's (its formula is Python code,
    # whose temporaries go at their last use: no C++ expression holds them)
    python_formulas: tuple[bool, ...] = ()
    # For each of backward_node_ops, its autograd Node's class name (manual_formulas.MANUAL_STATEMENTS)
    formula_nodes: tuple[str, ...] = ()
    # Storages a non-reentrant checkpoint's recomputation saved for the backward: the formula that unpacks one holds it
    # until it returns, before validate_outputs' ops; no Node does (held_tensors._RecomputedTensors)
    recomputed_saved: frozenset[StorageWeakRef] = frozenset()
    # For each of backward_node_ops, the last graph node its Node's evaluation ran (the formula, then the additions
    # into the next Nodes' input buffers); () where not observed
    evaluation_ends: tuple[int, ...] = ()
    # (node count, running module) at each tensor autograd saved outside a checkpoint, in order
    # (memplan.estimator.saved_tensors): where a checkpoint's recomputation would stop (memplan.planner.costs)
    saved_packs: tuple[tuple[int, str | None], ...] = ()
    # With gradient accumulation: what the previous micro-batch's loss (or keep-output's `out`), and its graph, hold
    # after its backward (what letting the traced micro-batch's go freed), live from the iteration's start until the
    # loop's variable is bound again, before the node `previous_micro_batch_freed_at` (liveness sizes each as its
    # storage)
    previous_micro_batch: tuple[PreviousMicroBatch, ...] = ()
    previous_micro_batch_freed_at: int = 0


@dataclass
class Observed:
    """What watched a recording besides the recorder, as it left it."""

    tracker: ModuleTracker  # which module ran each op
    eager_lifetimes: EagerLifetimes
    started: float  # perf_counter when the trace began
    unknown_ops: set[str]  # ran with a target behaviour memplan does not know
    resizes: list[StorageResize]  # FSDP2's
    swapped: SwappedStorages | None = None  # where a library swaps storages under parameters
    host: HostMemory | None = None  # --offload: the rank's host memory
    host_tensors: frozenset[StorageWeakRef] = frozenset()  # TracedStep.host_tensors
    # the CPU generator's state copied by checkpoints on the cpu target (memplan.estimator.rng_snapshots)
    rng_snapshots: list[StorageResize] = field(default_factory=list)
    # Python numbers ops were given for Tensor arguments, on the cpu target (memplan.estimator.wrapped_numbers)
    wrapped_numbers: list[StorageResize] = field(default_factory=list)
    saved_packs: list[tuple[int, str | None]] = field(default_factory=list)  # SavedTensors.packs
    # the storages the traced micro-batch's loss or output held once its backward was done, and the node before which
    # the previous micro-batch's went (TracedStep.previous_micro_batch)
    previous_graph: list[StorageWeakRef] = field(default_factory=list)
    previous_graph_freed_at: int = 0


def traced_step_from(
    graph: OpGraph,
    state: TrainingState,
    boundaries: dict[str, int],
    stored: tuple[dict[StorageWeakRef, str], dict[StorageWeakRef, int]],
    observed: Observed,
    recording: OptimizerRecording | None,
    released_early: list[tuple[StorageWeakRef, int, int]],
) -> TracedStep:
    """The TracedStep of a finished recording: phases from `boundaries` (the whole graph where a
    phase never ended), storages from `stored` (categories, sizes)."""
    node_count = len(graph.nodes)
    for key, category in sharding_categories(graph, observed.resizes).items():
        stored[0].setdefault(key, category)
    # The previous micro-batch's copies of what its graph holds: made by its forward, kept for its backward.
    previous = tuple(dict.fromkeys(PreviousMicroBatch(key) for key in observed.previous_graph if key not in stored[0]))
    for copy in previous:
        stored[0][copy] = "activations"
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
        formula_results=tuple(observed.eager_lifetimes.formula_results),
        python_formulas=tuple(observed.eager_lifetimes.python_formulas),
        formula_nodes=tuple(observed.eager_lifetimes.formula_nodes),
        evaluation_ends=tuple(observed.eager_lifetimes.evaluation_ends),
        recomputed_saved=frozenset(observed.eager_lifetimes.recomputed_saved),
        seconds=time.perf_counter() - observed.started,
        optimizer_recording=recording,
        unknown_target_ops=tuple(sorted(observed.unknown_ops)),
        released_early=tuple(released_early),
        storage_resizes=(*observed.resizes, *observed.rng_snapshots, *observed.wrapped_numbers),
        saved_packs=tuple(observed.saved_packs),
        previous_micro_batch=previous,
        previous_micro_batch_freed_at=observed.previous_graph_freed_at,
        swapped_storages=observed.swapped,
        host_memory=observed.host,
        host_tensors=observed.host_tensors,
    )


def _weights(param: torch.Tensor) -> int:
    """The weights a parameter stands for: a 4-bit layer's packed bytes hold two each, and a ZeRO-3
    parameter, an empty tensor between uses, keeps its full size as `ds_numel` (partition_parameters.py)."""
    full = getattr(param, "ds_numel", None)
    return int(full) if full is not None else logical_numel(param)


def categorize_storages(
    state: TrainingState, grads: list[torch.Tensor]
) -> tuple[dict[StorageWeakRef, str], dict[StorageWeakRef, int]]:
    categories: dict[StorageWeakRef, str] = {}
    sizes: dict[StorageWeakRef, int] = {}
    groups = {
        "communication": communication_tensors(state),
        "inputs": input_tensors(state),
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
