"""The simulation of a traced step: its memory timeline, its peak and the breakdown there, and on
the cuda target the caching allocator's figures (memplan.estimator.timeline). When each storage lives is
memplan.estimator.liveness's; what kernels request within an op, memplan.estimator.transients'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.estimator.cuda.allocator import AllocatorConfig
from memplan.estimator.liveness import (
    Liveness,
    ResizedStorage,
    host_peak_bytes,
    liveness,
    op_name,
    round_for_device,
)
from memplan.estimator.loop import LOOPS_KEEPING_GRADIENTS
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
from memplan.estimator.traced_step import TracedStep
from memplan.estimator.transients import (
    Scratch,
    cublas_workspaces,
    first_matmuls,
    kernel_transients,
    rounded_transients,
)


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


def _phase_of(index: int, traced: TracedStep) -> str:
    if index < traced.forward_end:
        return "forward"
    if index < traced.backward_end:
        return "backward"
    return "optimizer"


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
    exact, conv = kernel_transients(traced, nodes)
    transients = {**exact, **conv}
    timeline = memory_timeline(traced, lifetimes, workspaces, transients)
    config = traced.settings.allocator_config
    allocated, reserved = allocator_peak_bytes(timeline, config) if traced.settings.device == "cuda" else (None, None)
    low_peak = low_reserved = None  # only where there are convolutions on cuda
    if conv:
        low_peak = _live_bytes(traced, lifetimes, sum(workspaces), rounded_transients(exact, traced.settings))[1]
        low_reserved = reserved_peak_bytes(without_cudnn_workspaces(timeline), config)
    rounded = rounded_transients(transients, traced.settings)
    live_bytes, peak_bytes, peak_node, phase_peaks = _live_bytes(traced, lifetimes, sum(workspaces), rounded)

    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    breakdown["workspaces"] = sum(workspaces) + rounded.get(peak_node, 0)
    for key in size:
        if born[key] <= peak_node <= last_use[key]:
            breakdown[_category(key, born[key], last_use[key], traced)] += size[key]
    phase = _phase_of(peak_node, traced)
    return Simulation(
        peak_bytes=peak_bytes,
        peak_node=peak_node,
        phase=phase,
        breakdown=breakdown,
        phase_peak_bytes=phase_peaks,
        peak_op=op_name(nodes[peak_node]),
        # Forward ops only: a checkpoint's recomputation that stops early (torch's early stop) leaves no exit
        # for its module, whose name the backward's later ops would otherwise carry.
        peak_module=traced.node_modules[peak_node] if phase == "forward" else None,
        unsupported_ops=lifetimes.unsupported_ops,
        timeline_bytes=tuple(live_bytes),
        timeline=timeline,
        reserved_peak_bytes=reserved,
        allocated_peak_bytes=allocated,
        conv_workspace_free_peak_bytes=low_peak,
        conv_workspace_free_reserved_peak_bytes=low_reserved,
        allocator_config=config if reserved is not None else None,
        # the offloaded state's host memory; a GPU run's own host tensors (step counters, seeds: a few hundred
        # bytes) are left out of the device's figures but reported only beside an offload's
        host_peak_bytes=host_peak_bytes(lifetimes) if traced.host_memory is not None else None,
    )


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
                op=op_name(lifetimes.nodes[born]),
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
                    sized_call=request.sized_call,
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
