"""Storage-level liveness over a traced step: when each storage is allocated and freed.

Every tensor is keyed by its storage, so views and in-place results only extend their base's life.
A storage is allocated by the first node producing it and freed after the last node reading any
alias of it; placeholders (the batch), constants (parameters, buffers, optimizer state, existing
gradients) and graph outputs (gradients, freed by zero_grad at the iteration's end) persist. Storages
FSDP2 resizes are an allocation per resize; under offload the host's storages are kept apart.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.estimator.cuda.allocator import round_size
from memplan.estimator.cuda.host_tensors import host_operands
from memplan.estimator.formula_blocks import formula_blocks
from memplan.estimator.leaves import map_leaves, tensors_in
from memplan.estimator.opgraph import OpNode
from memplan.estimator.oprules import OUTPUT_BYTES_RULES
from memplan.estimator.swapped_storages import settle_lifetimes
from memplan.estimator.traced_step import TracedStep
from memplan.settings import TrainingSettings


def round_for_device(num_bytes: int, settings: TrainingSettings) -> int:
    """memory_allocated() counts each request rounded up to the caching allocator's 512-byte blocks
    (or its power-of-two divisions, where PYTORCH_CUDA_ALLOC_CONF sets them)."""
    if settings.device != "cuda" or num_bytes == 0:
        return num_bytes
    return round_size(num_bytes, settings.allocator_config)


def _returns_tensor(node: OpNode) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any("Tensor" in str(ret.type) for ret in schema.returns)


def op_name(node: OpNode) -> str:
    return str(node.target) if node.op == "call_function" else node.op


def _node_storages(node: OpNode, unsupported: dict[str, None], device: str) -> list[tuple[StorageWeakRef, int]]:
    if "val" in node.meta:
        value = node.meta["val"]
    else:
        if node.op == "call_function" and _returns_tensor(node):
            unsupported[op_name(node)] = None
        return []
    rule = OUTPUT_BYTES_RULES.get(node.target) if node.op == "call_function" else None
    true_bytes = rule(*fake_args(node), device) if rule is not None else None
    # One entry a storage: an op returning many views of one storage (`unbind` or `split` over the batch: a
    # vision-language model's image features, one tensor a sample) gave one entry a view, and every loop over a
    # reader's inputs walked them all: at the batch sizes a largest-batch search tries (thousands), 57 million
    # lookups a liveness pass, 157 s for a tiny LLaVA's search on an H100.
    storages: dict[StorageWeakRef, int] = {}
    for position, tensor in enumerate(tensors_in(value)):
        if tensor.layout != torch.strided:
            unsupported[f"{op_name(node)} ({tensor.layout})"] = None
            continue
        storage = tensor.untyped_storage()
        nbytes = true_bytes[position] if true_bytes is not None else storage.nbytes()
        key = StorageWeakRef(storage)
        storages[key] = max(storages.get(key, 0), nbytes)
    return list(storages.items())


def fake_args(node: OpNode) -> tuple[tuple, dict]:
    """The node's arguments with every graph node replaced by its fake value."""

    def value_of(arg: object) -> object:
        return arg.meta.get("val") if isinstance(arg, OpNode) else arg

    args = map_leaves(node.args, OpNode, value_of)
    kwargs = map_leaves(node.kwargs, OpNode, value_of)
    return tuple(args), dict(kwargs)


@dataclass(frozen=True)
class Liveness:
    """When each storage is allocated and freed, by node index (`len(nodes)` = the iteration's end)."""

    nodes: list[OpNode]
    storages: list[list[tuple[StorageWeakRef, int]]]  # each node's output storages and their bytes
    size: dict[StorageWeakRef, int]  # what memory_allocated counts (rounded to 512 B on cuda)
    born: dict[StorageWeakRef, int]
    last_use: dict[StorageWeakRef, int]
    unsupported_ops: tuple[str, ...]
    requested: dict[StorageWeakRef, int]  # the bytes asked for, before the allocator's rounding
    streams: dict[StorageWeakRef, int] = field(default_factory=dict)  # those allocated on a side stream
    # --offload: the storages in host memory, (born, last use, host bytes) each, kept out of the rest
    host: dict[Any, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ResizedStorage:
    """One allocation of a storage that FSDP2 resizes (memplan.distributed.fsdp): the storage from one
    resize to a size above zero until the next resize, each a storage of its own to the allocator."""

    storage: StorageWeakRef
    allocation: int


class _Allocation(NamedTuple):
    """One allocation of a resized storage."""

    first: int  # node
    last: int  # the last node it lives through
    nbytes: int
    stream: int  # the stream it was allocated on (0, the default)


def _resized_allocations(traced: TracedStep, end: int) -> dict[StorageWeakRef, list[_Allocation]]:
    """For each resized storage, its allocations, in order. One that spans no node (allocated after the
    last op) is left out: it is alive when the next iteration begins, as its first resize says."""
    allocations: dict[StorageWeakRef, list[_Allocation]] = {}
    opened: dict[StorageWeakRef, tuple[int, int, int]] = {}
    for resize in traced.storage_resizes:
        allocations.setdefault(resize.storage, [])
        if resize.storage not in opened and resize.before_bytes and not allocations[resize.storage]:
            opened[resize.storage] = (0, resize.before_bytes, 0)  # allocated when the iteration began
        if resize.storage in opened:
            start, nbytes, stream = opened.pop(resize.storage)
            allocations[resize.storage].append(_Allocation(start, resize.at - 1, nbytes, stream))
        if resize.after_bytes:
            opened[resize.storage] = (resize.at, resize.after_bytes, resize.stream)
    for key, (start, nbytes, stream) in opened.items():
        allocations[key].append(_Allocation(start, end, nbytes, stream))
    return {key: [a for a in found if a.first < end and a.first <= a.last] for key, found in allocations.items()}


def _split_resized(
    storages: list[list[tuple[StorageWeakRef, int]]], allocations: dict[StorageWeakRef, list[_Allocation]]
) -> None:
    """Each node's resized storages replaced by the allocation live at that node (none while freed)."""
    for index, outputs in enumerate(storages):
        if not any(key in allocations for key, _ in outputs):
            continue
        split: list[tuple[Any, int]] = []
        for key, nbytes in outputs:
            if key not in allocations:
                split.append((key, nbytes))
                continue
            for number, allocation in enumerate(allocations[key]):
                if allocation.first <= index <= allocation.last:
                    split.append((ResizedStorage(key, number), allocation.nbytes))
        storages[index] = split


def liveness(traced: TracedStep) -> Liveness:
    nodes = list(traced.graph.nodes)
    unsupported: dict[str, None] = {}
    storages = [_node_storages(node, unsupported, traced.settings.device) for node in nodes]
    index_of = {node: index for index, node in enumerate(nodes)}
    resized = _resized_allocations(traced, len(nodes))
    _split_resized(storages, resized)

    requested: dict[StorageWeakRef, int] = {}
    born: dict[StorageWeakRef, int] = {}
    last_use: dict[StorageWeakRef, int] = {}
    for index, node in enumerate(nodes):
        for key, nbytes in storages[index]:
            requested[key] = max(requested.get(key, 0), nbytes)
            born.setdefault(key, index)
            last_use[key] = index
        for source in node.all_input_nodes:
            for key, _ in storages[index_of[source]]:
                last_use[key] = index
    for key, end in traced.python_lifetimes:
        if key in last_use:
            last_use[key] = max(last_use[key], end)
    results = traced.formula_results or (None,) * len(traced.backward_node_ops)
    python_formulas = traced.python_formulas or (False,) * len(traced.backward_node_ops)
    node_names = traced.formula_nodes or (None,) * len(traced.backward_node_ops)
    for formula, returned, in_python, node_name in zip(
        traced.backward_node_ops, results, python_formulas, node_names, strict=True
    ):
        if not formula:
            continue
        last = formula[-1]
        block_ends = (
            formula_blocks(formula, returned, nodes, storages, born, index_of, node_name)
            if returned is not None and not in_python
            else None
        )
        # The formula's own temporaries are what its own ops made. Not every storage born after its first op: a
        # checkpointed forward recomputed while the formula unpacks a saved tensor runs between its ops (the detach
        # that unpacks the checkpoint's inputs is the formula's first op). A tensor its Node saved is held until the
        # engine releases the Node's variables, after validate_outputs (evaluate_function, engine.cpp); one a
        # checkpoint's recomputation saved only by the formula's locals, which go as it returns, before
        # validate_outputs' ops (held_tensors._RecomputedTensors: a recomputed Linear input, freed before its
        # bias's gradient was summed, was held through the sum here, 256 B high).
        own = frozenset(formula)
        for index in formula:
            for source in nodes[index].all_input_nodes:
                if index_of[source] in traced.formula_casts:
                    continue
                for key, _ in storages[index_of[source]]:
                    end = last  # the incoming gradients, saved tensors and what the Node returns
                    if in_python and born[key] in own:
                        # A Python Function's backward (PyNode::apply): Python frees its temporaries at their last
                        # use, and its frames' variables are observed as the model's are (EagerLifetimes).
                        continue
                    if block_ends is not None and born[key] in own:  # the formula's own temporaries
                        if key in block_ends.validated_from:
                            end = last_use[key]
                        elif key in block_ends.named_locals:  # until its scope ends
                            end = block_ends.named_locals[key]
                        elif key not in block_ends.results:
                            end = block_ends.end_after(last_use[key], born[key])
                    elif block_ends is not None and key in traced.recomputed_saved:
                        end = block_ends.ends[-1]  # the formula's own last op
                    last_use[key] = max(last_use[key], end)
    # What a Node returned is held by the engine's `outputs` (evaluate_function, torch/csrc/autograd/engine.cpp)
    # until its evaluation returns, past the additions that accumulate each into the next Node's input buffer:
    # InputBuffer::add moves a gradient into an empty slot, but accumulates one into a filled slot by reference
    # (`old_var.add_(var)` or `old_var + var`, torch/csrc/autograd/input_buffer.cpp, accumulate), which leaves it
    # in `outputs`. A gradient added out of place in the trace (fake tensors always are) was freed at that
    # addition, before the Node's later outputs were accumulated.
    ends = traced.evaluation_ends or (None,) * len(traced.backward_node_ops)
    for returned, evaluation_end in zip(results, ends, strict=True):
        if returned is None or evaluation_end is None:
            continue
        for key in returned:
            if key in last_use:
                last_use[key] = max(last_use[key], evaluation_end)
    for key, nbytes, end in traced.released_early:
        requested[key] = nbytes
        born[key], last_use[key] = 0, end
    # Live before the iteration: the batch, constants, and categorized storages the graph never reads.
    # Not those released early: a gradient the step began with and accumulated into in place (a backward before its
    # zero_grad) is read by the graph, so a placeholder, yet freed where the step let it go, not at the end.
    released = {key for key, _, _ in traced.released_early}
    static = {
        key
        for index, node in enumerate(nodes)
        if node.op in ("placeholder", "get_attr") and "freed_after" not in node.meta
        for key, _ in storages[index]
        if key not in released
    }
    for index, node in enumerate(nodes):  # a real tensor made for one op (memplan.estimator.recorder.node_of)
        if node.op == "get_attr" and "freed_after" in node.meta:
            for key, _ in storages[index]:
                last_use[key] = max(last_use[key], node.meta["freed_after"])
    for key, nbytes in traced.storage_bytes.items():
        if key not in requested:
            requested[key] = nbytes
            static.add(key)
    static = {key for key in static if not isinstance(key, ResizedStorage)}
    # The previous micro-batch's loss (or output) and graph, alive until the forward binds the loop's variable again:
    # a copy of each storage it holds, of that storage's size, from the iteration's start.
    for copy in traced.previous_micro_batch if traced.previous_micro_batch_freed_at > 0 else ():
        if copy.storage in requested and copy.storage not in static:
            requested[copy] = requested[copy.storage]
            born[copy], last_use[copy] = 0, traced.previous_micro_batch_freed_at - 1
    for key in static:
        born[key] = 0
    # Live until the iteration ends: the static storages and the graph outputs (gradients until zero_grad).
    end = len(nodes)
    read_until = dict(last_use) if traced.swapped_storages is not None else {}
    for key in static:
        last_use[key] = end
    if traced.swapped_storages is not None:
        settle_lifetimes(traced.swapped_storages, static, read_until, last_use, end)
    for source in nodes[-1].all_input_nodes if nodes and nodes[-1].op == "output" else []:
        for key, _ in storages[index_of[source]]:
            last_use[key] = end
    # Each allocated on the stream of the op that made it (memplan.estimator.recorder.current_side_stream).
    streams = {key: stream for key, index in born.items() if (stream := nodes[index].meta.get("stream"))}
    for key, allocations in resized.items():  # allocated and freed where FSDP2 resized them, used or not
        for number, allocation in enumerate(allocations):
            resized_key = ResizedStorage(key, number)
            requested[resized_key], born[resized_key] = allocation.nbytes, allocation.first
            last_use[resized_key] = allocation.last
            streams.pop(resized_key, None)
            if allocation.stream:
                streams[resized_key] = allocation.stream
    unsupported.update(dict.fromkeys(traced.unknown_target_ops))
    host = _host_lifetimes(
        traced, requested, born, last_use, streams, host_operands(nodes, storages, traced.host_tensors)
    )
    size = {key: round_for_device(nbytes, traced.settings) for key, nbytes in requested.items()}
    return Liveness(nodes, storages, size, born, last_use, tuple(unsupported), requested, streams, host)


def _host_lifetimes(
    traced: TracedStep,
    requested: dict[Any, int],
    born: dict[Any, int],
    last_use: dict[Any, int],
    streams: dict[Any, int],
    host_tensors: set[Any],
) -> dict[Any, tuple[int, int, int]]:
    """Under offload, the host's storages taken out of the device's tables: what the rank keeps there
    (FSDP2's shards, gradients, optimizer state and gradient copies: memplan.distributed.offload;
    DeepSpeed's master partitions, their gradients, optimizer state and staging buffers:
    memplan.distributed.deepspeed), and whatever the host's computation makes (its windows, or for FSDP2
    the whole optimizer step); on the cuda target, what a GPU run keeps there besides (TracedStep.host_tensors)."""
    host_memory = traced.host_memory
    if host_memory is None and not host_tensors:
        return {}
    windows: tuple[tuple[int, int], ...] = ()
    if host_memory is not None:
        windows = host_memory.windows if host_memory.windows is not None else ((traced.backward_end, sys.maxsize),)
    host = {}
    for key in list(requested):
        base = key.storage if isinstance(key, ResizedStorage) else key
        offloaded = host_memory is not None and base in host_memory.storages
        if offloaded or base in host_tensors or any(start <= born[key] < end for start, end in windows):
            nbytes = host_memory.bytes_of(base, requested[key]) if host_memory is not None else requested[key]
            host[key] = (born[key], last_use[key], nbytes)
            for table in (requested, born, last_use, streams):
                table.pop(key, None)
    return host


def host_peak_bytes(lifetimes: Liveness) -> int | None:
    """The most host bytes live at once under --offload (None without it)."""
    if not lifetimes.host:
        return None
    change = [0] * (len(lifetimes.nodes) + 2)
    for first, last, nbytes in lifetimes.host.values():
        change[first] += nbytes
        change[last + 1] -= nbytes
    live = peak = 0
    for delta in change:
        live += delta
        peak = max(peak, live)
    return peak
