"""The predicted iteration allocation by allocation: what `--plot` draws and `--snapshot` writes.

Node indices are positions in the traced graph; an allocation is live from `allocated_at` through
`freed_at` inclusive (the simulation counts a node's outputs and inputs as live while it runs),
and `freed_at == node_count` means it outlives the iteration (parameters, optimizer state, the
batch, and the gradients until zero_grad).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate
from typing import ClassVar, Protocol

from memplan.estimator.cuda.allocator import (
    DEFAULT_CONFIG,
    ROUND_LARGE_BYTES,
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
)
from memplan.estimator.cuda.cudnn import CUDNN_WORKSPACE


class SizedCall(Protocol):
    """A kernel call that sizes one of its requests by a rule that is not affine in the batch (a CUDA reduction's
    staging, memplan.estimator.cuda.reductions; the embedding backward's sort and partial sums, memplan.estimator.
    cuda.embedding_backward): a frozen dataclass whose SCALED_FIELDS are what the batch scales (each affine in it)
    and the rest what stays; `requests()` is every request of the call, `part` which one this is, `bytes()` its
    bytes, 0 where the call makes no such request at this size (memplan.estimator.interpolate)."""

    SCALED_FIELDS: ClassVar[tuple[str, ...]]
    part: int

    def requests(self) -> tuple[int, ...]: ...

    def bytes(self) -> int: ...


BREAKDOWN_KEYS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "inputs",
    "workspaces",
    "communication",
    "unsharded_parameters",
)
PHASES = ("forward", "backward", "optimizer")
# Steady state: the allocator's segments after this many iterations (they are never released, and
# the third iteration reuses what the first two cached; see replay_steady_state).
STEADY_STATE_ITERATIONS = 3
# With gradient accumulation, the micro-batches of an iteration replayed: the first (which makes the
# gradients), one between (which finds them), and the last (then the optimizer step). Further
# micro-batches between repeat the same requests on segments that are never released, so a
# second one between reuses what the first cached.
MICRO_BATCHES_REPLAYED = 3


@dataclass(frozen=True)
class TimelineAllocation:
    allocated_at: int
    freed_at: int
    size_bytes: int
    category: str  # one of BREAKDOWN_KEYS
    op: str  # the aten op (or placeholder / get_attr) that produced it
    module: str | None  # the module running when it was produced, if any
    requested_bytes: int | None = None  # before the allocator's rounding, where it differs from size_bytes
    # The CUDA stream it is allocated on, whose pool caches it when freed: 0, the default stream,
    # for everything a single-GPU step allocates (the autograd engine's device thread runs on the
    # same current stream); other numbers for side streams such as collective communication's.
    stream: int = 0
    # A kernel's request whose size is not affine in the batch (a CUDA reduction's staging: Reduce.cuh's plan;
    # CUDA's embedding backward): the call, to size it at another batch size (memplan.estimator.interpolate).
    sized_call: SizedCall | None = None
    # A library call's transient that is freed as soon as that call ends, before the op's next
    # request (allocated_at == freed_at): a convolution backward's backward-data workspace is gone
    # before its backward-weight workspace is requested.
    sequential: bool = False
    # Gradient accumulation (MemoryTimeline.micro_batches > 1): the first micro-batch of an iteration
    # finds no gradients (zero_grad freed them), and AccumulateGrad keeps the new gradient a backward
    # op made as the parameter's .grad. On such a temporary, `becomes_gradient`: in the first
    # micro-batch it is not freed but lives until zero_grad; on the gradient it becomes,
    # `made_in_first_micro_batch`: not allocated before the iteration.
    becomes_gradient: bool = False
    made_in_first_micro_batch: bool = False
    # Kept from the first iteration on, but made lazily: the first iteration (its first micro-batch)
    # requests it at this node, after the node's own outputs; a cuBLAS workspace at its thread's first
    # matmul. Later iterations find it. Where it lands is decided by what that first iteration has
    # free at that moment (measured on the H100, gpt2 bf16: the backward thread's workspace split one
    # of the cached logits segments).
    first_used_at: int | None = None

    def persists(self, node_count: int) -> bool:
        """Alive before the iteration starts and after it ends: parameters, state, the batch, workspaces."""
        return self.allocated_at == 0 and self.freed_at == node_count


@dataclass(frozen=True)
class MemoryTimeline:
    node_count: int
    forward_end: int  # first node of the backward pass
    backward_end: int  # first node of the optimizer step
    allocations: tuple[TimelineAllocation, ...]  # in the order the step requests them
    # Gradient accumulation: the iteration runs the traced micro-batch's forward and backward this
    # many times, the optimizer step after the last (replay_steady_state).
    micro_batches: int = 1

    @cached_property
    def replay_schedule(self) -> ReplaySchedule:
        """Its requests grouped as the allocator replay walks them (made when first asked, then kept)."""
        return ReplaySchedule.of(self)

    @cached_property
    def unlimited_allocator_peaks(self) -> dict[AllocatorConfig, tuple[int, int]]:
        """allocator_peak_bytes's answers on a device without limit, by configuration, once each."""
        return {}

    def phase_starts(self) -> dict[str, int]:
        return {"forward": 0, "backward": self.forward_end, "optimizer": self.backward_end}

    def category_bytes(self) -> dict[str, list[int]]:
        """Live bytes of each category at every node (the same counting as the peak)."""
        deltas = {key: [0] * (self.node_count + 1) for key in BREAKDOWN_KEYS}
        largest_in_turn: dict[int, TimelineAllocation] = {}
        for allocation in self.allocations:  # of a node's requests in turn, only the largest is ever live
            if allocation.sequential:
                other = largest_in_turn.get(allocation.allocated_at)
                if other is None or allocation.size_bytes > other.size_bytes:
                    largest_in_turn[allocation.allocated_at] = allocation
        for allocation in self.allocations:
            if allocation.sequential and largest_in_turn[allocation.allocated_at] is not allocation:
                continue
            delta = deltas[allocation.category]
            delta[allocation.allocated_at] += allocation.size_bytes
            if allocation.freed_at < self.node_count:
                delta[allocation.freed_at + 1] -= allocation.size_bytes
        return {key: list(accumulate(delta[: self.node_count])) for key, delta in deltas.items()}

    def total_bytes(self) -> list[int]:
        per_category = self.category_bytes()
        return [sum(values) for values in zip(*per_category.values(), strict=True)]


AllocatorEvent = Callable[[str, int, TimelineAllocation], None]  # (action, allocator handle, allocation)


def replay_steady_state(
    timeline: MemoryTimeline,
    allocator: CachingAllocator,
    on_event: AllocatorEvent | None = None,
    on_last_iteration: Callable[[], None] | None = None,
    iterations: int = STEADY_STATE_ITERATIONS,
) -> None:
    """Run the iteration's requests through `allocator` as a training loop would reach steady state.

    What lives through the whole iteration (parameters, buffers, the batch) is allocated first, in
    request order; then the iteration's allocations and frees run `iterations` times
    (STEADY_STATE_ITERATIONS), and the peak statistics are reset before the last one, as `memplan
    validate` resets them before its measured iteration. `on_event(action, handle, allocation)`
    sees the "persistent" allocations and the last iteration's "alloc"s and "free"s;
    `on_last_iteration()` is called as that iteration starts.
    Two kinds of persistent allocation are made inside the first iteration instead, where the
    segments it then lands in, or opens, are what later iterations find:
    - the optimizer state: torch.optim creates it inside the first step (`_init_group`: zeros_like
      per parameter as the step begins), so the first iteration allocates it where its optimizer
      step starts, in request order (design.md: +4.3% reserved on gpt2, -4.8% on ResNet-50
      against allocating it first);
    - the cuBLAS workspaces (`first_used_at`): each at its thread's first matmul. Measured on the
      H100, gpt2 bf16: the backward thread's 32 MiB workspace split one of the four cached 3,142
      MiB logits segments, the AdamW state of the embedding followed it there, and every later
      iteration opened a fourth segment; reserved -13.9% with the workspaces allocated first,
      -0.4% so.
    With gradient accumulation (`timeline.micro_batches` > 1) an iteration runs the traced
    micro-batch's forward and backward for its first, one middle and its last micro-batch
    (MICRO_BATCHES_REPLAYED), the optimizer step after the last. The gradients are not there
    before the iteration: the first micro-batch's new gradients become them (`becomes_gradient`)
    and live until zero_grad frees them after the step. Measured on the H100 (gpt2, SGD, 4
    micro-batches): reserved +7.1% with the gradients allocated first, +0.6% so.
    """
    schedule = timeline.replay_schedule
    for allocation in schedule.persistent:
        handle = allocator.malloc(allocation.size_bytes, allocation.stream)
        if on_event is not None:
            on_event("persistent", handle, allocation)
    first_step_state, made_lazily, backward_end = schedule.first_step_state, schedule.made_lazily, schedule.backward_end
    replayed = min(timeline.micro_batches, MICRO_BATCHES_REPLAYED)
    malloc, malloc_or_none, free = allocator.malloc, allocator.malloc_or_none, allocator.free

    def micro_batch(iteration: int, number: int, gradients: list[tuple[int, TimelineAllocation]]) -> None:
        """One micro-batch: forward and backward, and after the last the optimizer step."""
        last, final = iteration == iterations - 1, number == replayed - 1
        first_of_several = number == 0 and replayed > 1
        events = on_event if last else None
        handles: dict[int, tuple[int, TimelineAllocation]] = {}
        stop = schedule.node_count + 1 if final else backward_end
        for index, starts, ends in schedule.nodes:
            if index >= stop:
                break
            if iteration == 0 and final and index == backward_end:
                for allocation in first_step_state:
                    handle = malloc(allocation.size_bytes, allocation.stream)
                    if on_event is not None:
                        on_event("persistent", handle, allocation)
            for allocation, kind in starts:
                if kind is _WORKSPACE:
                    # Conv_v8.cpp try_configs: a plan whose workspace cannot be allocated (after the
                    # allocator released its cache) is skipped for the next, down to a fallback
                    # that needs none: the convolution runs without it.
                    handle = malloc_or_none(allocation.size_bytes, allocation.stream)
                    if handle is None:
                        continue
                else:
                    handle = malloc(allocation.size_bytes, allocation.stream)
                if events is not None:
                    events("alloc", handle, allocation)
                if allocation.sequential:  # freed before the node's next request
                    free(handle)
                    if events is not None:
                        events("free", handle, allocation)
                elif first_of_several and allocation.becomes_gradient:
                    gradients.append((handle, allocation))  # the parameter's .grad until zero_grad
                else:
                    handles[id(allocation)] = (handle, allocation)
            if iteration == 0 and (number == 0 or index >= backward_end):  # the optimizer's after the last
                for allocation in made_lazily.get(index, ()):
                    handle = malloc(allocation.size_bytes, allocation.stream)
                    if on_event is not None:
                        on_event("persistent", handle, allocation)
            for allocation in ends:
                entry = handles.pop(id(allocation), None)
                if entry is None:
                    continue  # a workspace cuDNN went without
                free(entry[0])
                if events is not None:
                    events("free", entry[0], allocation)
        for handle, allocation in handles.values():  # a micro-batch before the last: its backward ended
            free(handle)
            if events is not None:
                events("free", handle, allocation)

    for iteration in range(iterations):
        if iteration == iterations - 1:
            allocator.reset_peak_stats()
            if on_last_iteration is not None:
                on_last_iteration()
        gradients: list[tuple[int, TimelineAllocation]] = []
        for number in range(replayed):
            micro_batch(iteration, number, gradients)
        for handle, allocation in gradients:  # zero_grad(set_to_none=True) after the step
            free(handle)
            if iteration == iterations - 1 and on_event is not None:
                on_event("free", handle, allocation)


_WORKSPACE = "workspace"  # a start's kind in a ReplaySchedule: a cuDNN workspace cuDNN can go without


@dataclass(frozen=True)
class ReplaySchedule:
    """A timeline's requests grouped as replay_steady_state walks them, made once per timeline (a device fit
    replays one timeline a dozen times): only the nodes where something happens, each with its requests (and
    whether each is a cuDNN workspace) and the requests freed after it, in request order."""

    node_count: int
    backward_end: int
    persistent: tuple[TimelineAllocation, ...]  # allocated before the iteration, in request order
    first_step_state: tuple[TimelineAllocation, ...]  # the optimizer state, made as the first step starts
    made_lazily: dict[int, tuple[TimelineAllocation, ...]]  # node -> kept from the first iteration's use on
    # (node, its requests with their kind, the requests freed after it), in node order
    nodes: tuple[tuple[int, tuple[tuple[TimelineAllocation, str | None], ...], tuple[TimelineAllocation, ...]], ...]

    @classmethod
    def of(cls, timeline: MemoryTimeline) -> ReplaySchedule:
        end = timeline.node_count
        starts: dict[int, list[tuple[TimelineAllocation, str | None]]] = defaultdict(list)
        ends: dict[int, list[TimelineAllocation]] = defaultdict(list)
        persistent: list[TimelineAllocation] = []
        first_step_state: list[TimelineAllocation] = []
        made_lazily: dict[int, list[TimelineAllocation]] = defaultdict(list)
        for allocation in timeline.allocations:
            if allocation.size_bytes == 0:
                continue  # a 0-byte request allocates nothing
            if allocation.persists(end):
                if allocation.made_in_first_micro_batch:
                    continue  # a temporary of the first micro-batch becomes it
                if allocation.category == "optimizer_state":
                    first_step_state.append(allocation)
                elif allocation.first_used_at is not None:
                    made_lazily[allocation.first_used_at].append(allocation)
                else:
                    persistent.append(allocation)
                continue
            if allocation.allocated_at < end:
                kind = _WORKSPACE if allocation.op.startswith(CUDNN_WORKSPACE) else None
                starts[allocation.allocated_at].append((allocation, kind))
            if not allocation.sequential:
                ends[allocation.freed_at].append(allocation)
        backward_end = min(timeline.backward_end, end)
        indices = sorted({*starts, *ends, *made_lazily, backward_end})
        nodes = tuple((index, tuple(starts.get(index, ())), tuple(ends.get(index, ()))) for index in indices)
        lazily = {index: tuple(allocations) for index, allocations in made_lazily.items()}
        return cls(end, backward_end, tuple(persistent), tuple(first_step_state), lazily, nodes)


def without_cudnn_workspaces(timeline: MemoryTimeline) -> MemoryTimeline:
    """The same iteration with every cuDNN convolution workspace at 0 bytes: the band's low end."""
    kept = tuple(a for a in timeline.allocations if not a.op.startswith(CUDNN_WORKSPACE))
    return timeline if len(kept) == len(timeline.allocations) else replace(timeline, allocations=kept)


def reserved_peak_bytes(
    timeline: MemoryTimeline, config: AllocatorConfig = DEFAULT_CONFIG, capacity_bytes: int | None = None
) -> int:
    """max_memory_reserved of the steady-state iteration: the timeline replayed through a fresh
    simulator, on a device of `capacity_bytes` for torch where given (the allocator then releases
    its cache and retries where a request does not fit, and cuDNN runs a plan without workspace
    where its workspace does not; OutOfMemory where the step does not complete)."""
    return allocator_peak_bytes(timeline, config, capacity_bytes)[1]


def allocator_peak_bytes(
    timeline: MemoryTimeline, config: AllocatorConfig = DEFAULT_CONFIG, capacity_bytes: int | None = None
) -> tuple[int, int]:
    """max_memory_allocated and max_memory_reserved of the steady-state iteration, from one replay
    (reserved_peak_bytes says how). The allocated figure is the allocator's own count: a request
    served by a cached block it does not split (a large block at most 1 MiB bigger, kSmallSize in
    CUDACachingAllocator.cpp) counts that whole block, as torch's allocated_bytes statistic does."""
    known = timeline.unlimited_allocator_peaks if capacity_bytes is None else {}
    if config not in known:  # a device fit and the figures shown beside it replay the same timeline
        allocator = CachingAllocator(config, capacity_bytes)
        replay_steady_state(timeline, allocator)
        known[config] = allocator.max_allocated_bytes, allocator.max_reserved_bytes
    return known[config]


def completes_within(timeline: MemoryTimeline, capacity_bytes: int, config: AllocatorConfig = DEFAULT_CONFIG) -> bool:
    """Whether the steady-state iteration runs on a device with `capacity_bytes` for torch, with the
    allocator freeing its cached segments and retrying when a cudaMalloc fails."""
    try:
        replay_steady_state(timeline, CachingAllocator(config, capacity_bytes))
    except OutOfMemory:
        return False
    return True


def smallest_device_bytes(
    timeline: MemoryTimeline,
    allocated_peak_bytes: int,
    reserved_peak_bytes: int,
    config: AllocatorConfig = DEFAULT_CONFIG,
) -> int:
    """The least device memory (for torch, so without the CUDA context) in which the iteration
    completes, found by bisection between its allocated and its reserved peak (the simulation's
    own figures) in the 2 MiB steps segments and pages come in.

    The bisection takes a capacity that works to leave every larger one working too, which holds
    almost always but not always (fits_within, which answers for one capacity, does not assume it).
    """
    step = ROUND_LARGE_BYTES
    low = -(-allocated_peak_bytes // step)  # in steps; below the allocated peak nothing runs
    high = -(-reserved_peak_bytes // step)
    while low < high:
        middle = (low + high) // 2
        if completes_within(timeline, middle * step, config):
            high = middle
        else:
            low = middle + 1
    return high * step


def fits_within(timeline: MemoryTimeline, capacity_bytes: int, config: AllocatorConfig = DEFAULT_CONFIG) -> bool:
    """Whether the iteration completes on a device with `capacity_bytes` for torch whichever plans
    cuDNN picks (both ends of a workspace band), replayed at that capacity itself: the allocator's
    retry is not monotone in capacity (a step that completes in c bytes can run out in c + 2 MiB,
    its segments falling differently), so a fit is never inferred from a smaller capacity."""
    return all(completes_within(end, capacity_bytes, config) for end in band_ends(timeline))


def band_ends(timeline: MemoryTimeline) -> list[MemoryTimeline]:
    """The timeline and, where it has cuDNN workspaces, the same without them: the workspace band's two ends."""
    workspace_free = without_cudnn_workspaces(timeline)
    return [timeline] if workspace_free is timeline else [timeline, workspace_free]


def device_fit_bytes(timeline: MemoryTimeline, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """What a device must hold for torch for the iteration to complete, whichever plans cuDNN picks:
    the larger of smallest_device_bytes for the timeline and for the same without its cuDNN
    workspaces (without them the segments fall differently and can need more). The figure shown
    and the one the batch search draws its lines through; whether a given budget fits is
    fits_within's answer at that budget."""
    ends = band_ends(timeline)
    # The bisection starts at the lowest allocated peak of the two ends: with workspaces the step
    # can complete below its own allocated peak, cuDNN going without what does not fit (the replay).
    lowest = min(max(end.total_bytes(), default=0) for end in ends)
    return max(smallest_device_bytes(end, lowest, reserved_peak_bytes(end, config), config) for end in ends)
