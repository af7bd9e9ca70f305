"""Storage-level liveness over a traced step: the memory timeline, its peak and the breakdown there.

Every tensor is keyed by its storage, so views and in-place results only extend their base's life.
A storage is allocated by the first node producing it and freed after the last node reading any
alias of it; placeholders (the batch), constants (parameters, buffers, optimizer state, existing
gradients) and graph outputs (gradients, freed by zero_grad at the iteration's end) persist.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.estimator.cuda.allocator import AllocatorConfig, round_size
from memplan.estimator.cuda.attention_scratch import CUDNN_BACKWARD, FLASH_BACKWARD, attention_backward_scratch
from memplan.estimator.cuda.cublas import cublas_workspace_bytes
from memplan.estimator.cuda.cudnn import (
    CONV_OPS,
    CUDNN_WORKSPACE,
    CudnnSwitches,
    conv_calls,
    workspace_band_bytes,
)
from memplan.estimator.cuda.reductions import Reduction, reduction_of
from memplan.estimator.leaves import map_leaves, tensors_in
from memplan.estimator.loop import LOOPS_KEEPING_GRADIENTS
from memplan.estimator.opgraph import OpNode
from memplan.estimator.oprules import OUTPUT_BYTES_RULES
from memplan.estimator.swapped_storages import settle_lifetimes
from memplan.estimator.timeline import (
    BREAKDOWN_KEYS,
    PHASES,
    MemoryTimeline,
    TimelineAllocation,
    allocator_peak_bytes,
    device_fit_bytes,
    fits_within,
    reserved_peak_bytes,
    without_cudnn_workspaces,
)
from memplan.estimator.trace import TracedStep
from memplan.finetune.bnb_kernels import gemm_4bit_scratch, int8_scratch, is_gemm_4bit, is_int8_op
from memplan.gpus import DEFAULT_GPU, gpu_named
from memplan.settings import TrainingSettings

# Ops that call cuBLAS on CUDA (aten/src/ATen/native/cuda/Blas.cpp).
CUBLAS_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._addmm_activation.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.addbmm.default,
    torch.ops.aten.mv.default,
    torch.ops.aten.addmv.default,
    torch.ops.aten.dot.default,
}


ATTENTION_BACKWARD_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
}


def round_for_device(num_bytes: int, settings: TrainingSettings) -> int:
    """memory_allocated() counts each request rounded up to the caching allocator's 512-byte blocks
    (or its power-of-two divisions, where PYTORCH_CUDA_ALLOC_CONF sets them)."""
    if settings.device != "cuda" or num_bytes == 0:
        return num_bytes
    return round_size(num_bytes, settings.allocator_config)


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    peak_node: int
    phase: str
    breakdown: dict[str, int]
    phase_peak_bytes: dict[str, int]
    peak_op: str
    peak_module: str | None
    unsupported_ops: tuple[str, ...]
    timeline_bytes: tuple[int, ...]
    timeline: MemoryTimeline
    reserved_peak_bytes: int | None = None  # cuda: what the caching allocator holds (max_memory_reserved)
    # cuda: max_memory_allocated as the caching allocator counts it (whole blocks where it hands out
    # a cached block unsplit), from the same replay; peak_bytes is the live tensors' bytes
    allocated_peak_bytes: int | None = None
    # cuda: the band's low end, every cuDNN convolution workspace 0 bytes (peak_bytes and
    # reserved_peak_bytes are the high end; memplan.estimator.cuda.cudnn)
    conv_workspace_free_peak_bytes: int | None = None
    conv_workspace_free_reserved_peak_bytes: int | None = None
    allocator_config: AllocatorConfig | None = field(default=None, compare=False, repr=False)  # cuda
    host_peak_bytes: int | None = None  # --offload params or optimizer: the rank's host memory at its peak

    @cached_property
    def smallest_device_bytes(self) -> int | None:
        """cuda: the least device memory (for torch) the iteration completes in, the allocator freeing its
        cached segments and retrying when a cudaMalloc fails; the larger of the band's two ends
        (memplan.estimator.timeline.device_fit_bytes). Found when first asked: a bisection of a dozen
        allocator replays, which an estimate's second trace (read for its per-sample slope) never needs."""
        if self.allocator_config is None:
            return None
        return device_fit_bytes(self.timeline, self.allocator_config)

    @property
    def fit_bytes(self) -> int:
        """What a memory budget must hold: on cuda the least device memory the step completes in
        (smallest_device_bytes, at most the reserved peak), else the allocated peak.

        With convolutions, the larger of the workspace band's two ends: without workspaces the
        segments fall differently and can need more (a workspace's cached segment can hold tensors
        that would otherwise open segments of their own), and cuDNN may pick either kind of plan."""
        if self.smallest_device_bytes is None:
            return self.peak_bytes
        return self.smallest_device_bytes

    def fits_within(self, budget_bytes: int) -> bool:
        """Whether the step fits `budget_bytes`: on cuda it completes on a device of that size
        (memplan.estimator.timeline.fits_within), else its peak is within it."""
        if self.smallest_device_bytes is None or self.allocator_config is None:
            return self.peak_bytes <= budget_bytes
        return fits_within(self.timeline, budget_bytes, self.allocator_config)

    @property
    def fit_phase_peaks(self) -> dict[str, int]:
        """fit_bytes by phase, for the largest-batch search (the device figure has no phases: one line)."""
        if self.smallest_device_bytes is not None:
            return {"device": self.fit_bytes}
        return dict(self.phase_peak_bytes)


def _returns_tensor(node: OpNode) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any("Tensor" in str(ret.type) for ret in schema.returns)


def _op_name(node: OpNode) -> str:
    return str(node.target) if node.op == "call_function" else node.op


def _node_storages(node: OpNode, unsupported: dict[str, None], device: str) -> list[tuple[StorageWeakRef, int]]:
    if "val" in node.meta:
        value = node.meta["val"]
    else:
        if node.op == "call_function" and _returns_tensor(node):
            unsupported[_op_name(node)] = None
        return []
    rule = OUTPUT_BYTES_RULES.get(node.target) if node.op == "call_function" else None
    true_bytes = rule(*_fake_args(node), device) if rule is not None else None
    storages = []
    for position, tensor in enumerate(tensors_in(value)):
        if tensor.layout != torch.strided:
            unsupported[f"{_op_name(node)} ({tensor.layout})"] = None
            continue
        storage = tensor.untyped_storage()
        nbytes = true_bytes[position] if true_bytes is not None else storage.nbytes()
        storages.append((StorageWeakRef(storage), nbytes))
    return storages


def _fake_args(node: OpNode) -> tuple[tuple, dict]:
    """The node's arguments with every graph node replaced by its fake value."""

    def value_of(arg: object) -> object:
        return arg.meta.get("val") if isinstance(arg, OpNode) else arg

    args = map_leaves(node.args, OpNode, value_of)
    kwargs = map_leaves(node.kwargs, OpNode, value_of)
    return tuple(args), dict(kwargs)


def _phase_of(index: int, traced: TracedStep) -> str:
    if index < traced.forward_end:
        return "forward"
    if index < traced.backward_end:
        return "backward"
    return "optimizer"


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
    for formula in traced.backward_node_ops:
        if not formula:
            continue
        last = formula[-1]
        for index in formula:
            for source in nodes[index].all_input_nodes:
                if index_of[source] in traced.formula_casts:
                    continue
                for key, _ in storages[index_of[source]]:
                    last_use[key] = max(last_use[key], last)
    for key, nbytes, end in traced.released_early:
        requested[key] = nbytes
        born[key], last_use[key] = 0, end
    # Live before the iteration: the batch, constants, and categorized storages the graph never reads.
    static = {
        key for index, node in enumerate(nodes) if node.op in ("placeholder", "get_attr") for key, _ in storages[index]
    }
    for key, nbytes in traced.storage_bytes.items():
        if key not in requested:
            requested[key] = nbytes
            static.add(key)
    static = {key for key in static if not isinstance(key, ResizedStorage)}
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
    host = _host_lifetimes(traced, requested, born, last_use, streams)
    size = {key: round_for_device(nbytes, traced.settings) for key, nbytes in requested.items()}
    return Liveness(nodes, storages, size, born, last_use, tuple(unsupported), requested, streams, host)


def _host_lifetimes(
    traced: TracedStep,
    requested: dict[Any, int],
    born: dict[Any, int],
    last_use: dict[Any, int],
    streams: dict[Any, int],
) -> dict[Any, tuple[int, int, int]]:
    """Under offload, the host's storages taken out of the device's tables: what the rank keeps there
    (FSDP2's shards, gradients, optimizer state and gradient copies: memplan.distributed.offload;
    DeepSpeed's master partitions, their gradients, optimizer state and staging buffers:
    memplan.distributed.deepspeed), and whatever the host's computation makes (its windows, or for FSDP2
    the whole optimizer step)."""
    host_memory = traced.host_memory
    if host_memory is None:
        return {}
    windows = host_memory.windows if host_memory.windows is not None else ((traced.backward_end, sys.maxsize),)
    host = {}
    for key in list(requested):
        base = key.storage if isinstance(key, ResizedStorage) else key
        if base in host_memory.storages or any(start <= born[key] < end for start, end in windows):
            host[key] = (born[key], last_use[key], host_memory.bytes_of(base, requested[key]))
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


def cublas_workspaces(traced: TracedStep) -> list[int]:
    """The cuBLAS workspaces a CUDA step holds: one per thread that runs a matmul.

    cuBLAS handles and their workspaces are per thread (CublasHandlePool.cpp), and the autograd
    engine runs CUDA backward formulas on its own device thread, so a step whose forward (or
    optimizer) and backward both multiply matrices holds two. They persist from the first step on.
    """
    if traced.settings.device != "cuda":
        return []
    capability = gpu_named(traced.settings.gpu or DEFAULT_GPU).compute_capability
    size = round_size(
        cublas_workspace_bytes(capability, traced.settings.cublas_workspace_config), traced.settings.allocator_config
    )
    return [size] * len(first_matmuls(traced))


def first_matmuls(traced: TracedStep) -> list[int]:
    """Per thread that multiplies matrices (the main thread's forward and optimizer step, then the
    autograd engine's device thread's backward), the index of its first matmul node: where the
    first iteration asks for that thread's cuBLAS workspace. The handle, and the workspace with it,
    is made on the thread's first cuBLAS call (getCurrentCUDABlasHandle, CublasHandlePool.cpp),
    once the op has allocated its output, and is kept after that."""
    nodes = list(traced.graph.nodes)
    threads = (
        [*range(traced.forward_end), *range(traced.backward_end, len(nodes))],
        range(traced.forward_end, traced.backward_end),
    )
    firsts = (next((i for i in thread if nodes[i].target in CUBLAS_OPS), None) for thread in threads)
    return [first for first in firsts if first is not None]


class Scratch(NamedTuple):
    """A transient request a CUDA kernel makes and frees within its op."""

    name: str  # what it is
    nbytes: int  # bytes requested
    reduction: Reduction | None = None  # a reduction's staging: to be sized anew at other batch sizes
    # Freed before the op's next request: one of several library calls the op makes in turn (a
    # convolution backward's backward-data, then backward-weight workspace). Requests that are not
    # sequential are held together until the op ends (attention backward scratch).
    sequential: bool = False


def _kernel_transients(
    traced: TracedStep, nodes: list[OpNode], targets: set | frozenset, rule: Callable[..., tuple[Scratch, ...]]
) -> dict[int, tuple[Scratch, ...]]:
    """`rule(node, args, settings)` for each node calling one of `targets`, by node index (cuda only;
    nodes whose rule requests nothing are left out)."""
    if traced.settings.device != "cuda":
        return {}
    transients = {}
    for index, node in enumerate(nodes):
        if node.op == "call_function" and node.target in targets:
            requests = rule(node, _fake_args(node)[0], traced.settings)
            if requests:
                transients[index] = requests
    return transients


def _conv_workspace(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """The workspaces (the band's top) of a convolution node's cuDNN calls: one forward; a backward
    node runs backward-data, then backward-weight, each freeing its workspace before the next starts."""
    capability = gpu_named(settings.gpu or DEFAULT_GPU).compute_capability
    cap = settings.cudnn_workspace_cap_mib
    switches = CudnnSwitches(settings.cudnn_allow_tf32, None if cap is None else cap * 2**20)
    name = f"{CUDNN_WORKSPACE} ({_op_name(node)})"
    highs = (
        workspace_band_bytes(call, capability, switches)[1]
        for call in conv_calls(node.target, args, node.meta.get("val"))
    )
    return tuple(Scratch(name, high, sequential=True) for high in highs if high)


def _attention_scratch(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """What an attention backward node allocates besides its gradients (memplan.estimator.cuda.attention_scratch)."""
    gpu = gpu_named(settings.gpu or DEFAULT_GPU)
    kernel = {FLASH_BACKWARD: "flash", CUDNN_BACKWARD: "cuDNN"}.get(node.target, "memory-efficient")
    splits_over = gpu.multiprocessors if settings.deterministic else None
    requests = attention_backward_scratch(node.target, args, gpu.compute_capability, splits_over)
    return tuple(Scratch(f"{kernel} attention backward scratch", nbytes) for nbytes in requests)


REDUCTION_OPS = {
    torch.ops.aten.sum.dim_IntList,
    torch.ops.aten.sum.default,
    torch.ops.aten.mean.dim,
    torch.ops.aten.mean.default,
}


def _reduction_staging(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """The global-memory staging of a CUDA sum or mean (memplan.estimator.cuda.reductions)."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or not source.is_contiguous() or source.dim() == 0:
        return ()
    with_dims = node.target in (torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim)
    dims = args[1] if len(args) > 1 and with_dims else None
    reduced = set(range(source.dim())) if not dims else {d % source.dim() for d in dims}
    gpu = gpu_named(settings.gpu or DEFAULT_GPU)
    reduction = reduction_of(tuple(source.shape), reduced, source.dtype, gpu.compute_capability, gpu.multiprocessors)
    if reduction is None:
        return ()
    name = f"reduction staging ({_op_name(node)})"
    # Both parts always, 0 bytes where this size reduces within blocks (the replay skips 0-byte
    # requests): the same requests at every batch size, so batch lines can size them anew.
    parts = (replace(reduction, part=0), replace(reduction, part=1))
    return tuple(Scratch(name, part.bytes(), part) for part in parts)


def _library_transients(nodes: list[OpNode], device: str) -> dict[int, tuple[Scratch, ...]]:
    """What library kernels allocate inside one op: bitsandbytes' 4-bit matmul dequantizes its
    weight there on every target; its 8-bit ops, run on the cuda target only (MatMul8bitLt), keep
    their int32 products and outlier masks there (memplan.finetune.bnb_kernels)."""
    transients = {}
    for index, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        if is_gemm_4bit(node.target):
            args, kwargs = _fake_args(node)
            scratch = gemm_4bit_scratch(args, kwargs, device)
        elif device == "cuda" and is_int8_op(node.target):
            args, kwargs = _fake_args(node)
            scratch = int8_scratch(node.target, args, kwargs)
        else:
            continue
        if scratch:
            transients[index] = tuple(Scratch(name, nbytes) for name, nbytes in scratch)
    return transients


def _live_bytes(
    traced: TracedStep, lifetimes: Liveness, persistent_bytes: int, transient: dict[int, int]
) -> tuple[list[int], int, int, dict[str, int]]:
    """Live bytes at every node, the peak and its node, and each phase's peak."""
    nodes, size, born, last_use = lifetimes.nodes, lifetimes.size, lifetimes.born, lifetimes.last_use
    allocations: list[list[StorageWeakRef]] = [[] for _ in nodes]
    frees: list[list[StorageWeakRef]] = [[] for _ in range(len(nodes) + 1)]
    for key in size:
        allocations[born[key]].append(key)
        frees[last_use[key]].append(key)
    live = persistent_bytes
    live_bytes = []
    peak_bytes, peak_node = -1, 0
    phase_peaks = dict.fromkeys(PHASES, 0)
    for index in range(len(nodes)):
        live += sum(size[key] for key in allocations[index])
        at_node = live + transient.get(index, 0)
        live_bytes.append(at_node)
        if at_node > peak_bytes:
            peak_bytes, peak_node = at_node, index
        phase = _phase_of(index, traced)
        phase_peaks[phase] = max(phase_peaks[phase], at_node)
        live -= sum(size[key] for key in frees[index])
    return live_bytes, peak_bytes, peak_node, phase_peaks


def simulate(traced: TracedStep, lifetimes: Liveness | None = None) -> Simulation:
    """`lifetimes`: the trace's liveness when the caller already has it."""
    lifetimes = lifetimes or liveness(traced)
    nodes, size, born, last_use = lifetimes.nodes, lifetimes.size, lifetimes.born, lifetimes.last_use
    workspaces = cublas_workspaces(traced)
    exact = {
        **_kernel_transients(traced, nodes, ATTENTION_BACKWARD_OPS, _attention_scratch),
        **_kernel_transients(traced, nodes, REDUCTION_OPS, _reduction_staging),
        **_library_transients(nodes, traced.settings.device),
    }  # in both ends of the band
    conv = _kernel_transients(traced, nodes, CONV_OPS, _conv_workspace)  # the band's top
    transients = {**exact, **conv}
    timeline = memory_timeline(traced, lifetimes, workspaces, transients)
    config = traced.settings.allocator_config
    allocated, reserved = allocator_peak_bytes(timeline, config) if traced.settings.device == "cuda" else (None, None)
    low_peak = low_reserved = None  # only where there are convolutions on cuda
    if conv:
        low_peak = _live_bytes(traced, lifetimes, sum(workspaces), _rounded(exact, traced.settings))[1]
        low_reserved = reserved_peak_bytes(without_cudnn_workspaces(timeline), config)
    rounded = _rounded(transients, traced.settings)
    live_bytes, peak_bytes, peak_node, phase_peaks = _live_bytes(traced, lifetimes, sum(workspaces), rounded)

    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    breakdown["workspaces"] = sum(workspaces) + rounded.get(peak_node, 0)
    for key in size:
        if born[key] <= peak_node <= last_use[key]:
            breakdown[_category(key, born[key], last_use[key], traced)] += size[key]
    return Simulation(
        peak_bytes=peak_bytes,
        peak_node=peak_node,
        phase=_phase_of(peak_node, traced),
        breakdown=breakdown,
        phase_peak_bytes=phase_peaks,
        peak_op=_op_name(nodes[peak_node]),
        peak_module=traced.node_modules[peak_node],
        unsupported_ops=lifetimes.unsupported_ops,
        timeline_bytes=tuple(live_bytes),
        timeline=timeline,
        reserved_peak_bytes=reserved,
        allocated_peak_bytes=allocated,
        conv_workspace_free_peak_bytes=low_peak,
        conv_workspace_free_reserved_peak_bytes=low_reserved,
        allocator_config=config if reserved is not None else None,
        host_peak_bytes=host_peak_bytes(lifetimes),
    )


def _rounded(transients: dict[int, tuple[Scratch, ...]], settings: TrainingSettings) -> dict[int, int]:
    """Bytes each node's transients add to memory_allocated while it runs: those held together, plus
    the largest of those requested in turn."""
    return {index: _node_transient_bytes(requests, settings) for index, requests in transients.items()}


def _node_transient_bytes(requests: tuple[Scratch, ...], settings: TrainingSettings) -> int:
    held = sum(round_for_device(r.nbytes, settings) for r in requests if not r.sequential)
    in_turn = max((round_for_device(r.nbytes, settings) for r in requests if r.sequential), default=0)
    return held + in_turn


def memory_timeline(
    traced: TracedStep,
    lifetimes: Liveness,
    workspaces: list[int],
    transients: dict[int, tuple[Scratch, ...]] | None = None,
) -> MemoryTimeline:
    """Every storage of the step with its lifetime and category, workspaces first, then in request order.

    A kernel's transients (a cuDNN workspace, attention backward scratch) are requested after the
    node's outputs and freed when it ends, or, where requested in turn (a convolution backward's
    two workspaces), each before the next.
    """
    end = len(lifetimes.nodes)
    allocations = [
        TimelineAllocation(0, end, size, "workspaces", "cublas workspace", None, first_used_at=first)
        for size, first in zip(workspaces, first_matmuls(traced) if workspaces else (), strict=True)
    ]
    becomes = _gradients_made_in_first_micro_batch(traced, lifetimes)
    made = set(becomes.values())
    for key, size in lifetimes.size.items():
        born, last_use = lifetimes.born[key], lifetimes.last_use[key]
        allocations.append(
            TimelineAllocation(
                allocated_at=born,
                freed_at=last_use,
                size_bytes=size,
                category=_category(key, born, last_use, traced),
                op=_op_name(lifetimes.nodes[born]),
                module=traced.node_modules[born],
                requested_bytes=lifetimes.requested[key],
                becomes_gradient=key in becomes,
                made_in_first_micro_batch=key in made,
                stream=lifetimes.streams.get(key, 0),
            )
        )
    for index, requests in (transients or {}).items():  # after the storages: the sort below is stable
        for request in requests:
            size = round_for_device(request.nbytes, traced.settings)
            allocations.append(
                TimelineAllocation(
                    index,
                    index,
                    size,
                    "workspaces",
                    request.name,
                    None,
                    request.nbytes,
                    reduction=request.reduction,
                    sequential=request.sequential,
                )
            )
    allocations.sort(key=lambda allocation: allocation.allocated_at)  # stable: request order within a node
    micro_batches = traced.settings.grad_accum if becomes else 1
    return MemoryTimeline(end, traced.forward_end, traced.backward_end, tuple(allocations), micro_batches)


def _gradients_made_in_first_micro_batch(
    traced: TracedStep, lifetimes: Liveness
) -> dict[StorageWeakRef, StorageWeakRef]:
    """With gradient accumulation, {new gradient's storage: the gradient storage it becomes}.

    The traced micro-batch is a later one: it finds every gradient allocated, and AccumulateGrad adds
    each new gradient into it (`variable.grad += new_grad`, one aten.add_ per parameter) and frees it.
    In the iteration's first micro-batch no gradient exists, and AccumulateGrad keeps the new one as
    `.grad` (torch/csrc/autograd/functions/accumulate_grad.h: stealing it where nothing else holds
    it), so that storage lives on until zero_grad. Only where the loop frees the gradients after the
    step and the two are the same size; a step without accumulation, or with a custom step, has none.
    """
    settings = traced.settings
    if settings.grad_accum <= 1 or settings.step is not None or settings.loop in LOOPS_KEEPING_GRADIENTS:
        return {}
    gradients = {key for key, category in traced.storage_categories.items() if category == "gradients"}
    index_of = {node: index for index, node in enumerate(lifetimes.nodes)}
    becomes: dict[StorageWeakRef, StorageWeakRef] = {}
    for index, node in enumerate(lifetimes.nodes):
        if not traced.forward_end <= index < traced.backward_end:
            continue  # AccumulateGrad runs in the backward; an optimizer's in-place add is not one
        if node.op != "call_function" or node.target != torch.ops.aten.add_.Tensor or len(node.args) < 2:
            continue
        outputs = [key for key, _ in lifetimes.storages[index] if key in gradients]
        source = node.args[1]
        if len(outputs) != 1 or source not in index_of:
            continue
        added = [key for key, _ in lifetimes.storages[index_of[source]]]
        if (
            len(added) == 1
            and lifetimes.last_use.get(added[0]) == index
            and lifetimes.size.get(added[0]) == lifetimes.size.get(outputs[0])
        ):
            becomes[added[0]] = outputs[0]
    return becomes


def _category(key: StorageWeakRef, born: int, last_use: int, traced: TracedStep) -> str:
    category = traced.storage_categories.get(key.storage if isinstance(key, ResizedStorage) else key)
    if category is not None:
        return category
    if born < traced.forward_end <= last_use < len(traced.node_modules):
        return "activations"  # made in the forward pass, read by the backward: saved for backward
    return "temporaries"
