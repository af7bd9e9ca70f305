"""Another batch size's memory timeline from two traced ones, where every size is affine in the batch.

A training step traced at two batch sizes usually makes the same requests in the same order; only
their sizes differ, and each size is `fixed + per_sample × batch` (activations, inputs and their
gradients scale with the batch, parameters and optimizer state do not). Where that holds for every
request, the step at any other batch size is the same requests at sizes on those lines: replaying
them through the caching-allocator simulator gives its reserved peak without a new trace. That is
what makes the largest-batch search cheap on the cuda target, whose reserved peak is a step
function of the batch size (allocator segments) that a search must probe point by point.

Nothing here is assumed: `fit` answers only when the two timelines have the same shape and every
size lands on an integer byte count, and the search uses it only after a third trace agreed with
it exactly (memplan.estimator.batch_tracer.BatchTracer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memplan.estimator.cuda.allocator import AllocatorConfig, round_size
from memplan.estimator.timeline import (
    MemoryTimeline,
    SizedCall,
    TimelineAllocation,
    device_fit_bytes,
    fits_within,
)
from memplan.settings import TrainingSettings


def _requested(allocation: TimelineAllocation) -> int:
    return allocation.size_bytes if allocation.requested_bytes is None else allocation.requested_bytes


def _same_shape(first: MemoryTimeline, second: MemoryTimeline) -> bool:
    if (first.node_count, first.forward_end, first.backward_end) != (
        second.node_count,
        second.forward_end,
        second.backward_end,
    ) or len(first.allocations) != len(second.allocations):
        return False
    return all(
        (a.allocated_at, a.freed_at, a.category, a.op) == (b.allocated_at, b.freed_at, b.category, b.op)
        for a, b in zip(first.allocations, second.allocations, strict=True)
    )


@dataclass(frozen=True)
class BatchLines:
    """Two traced timelines of one step; `timeline_at(batch)` puts every request on its line."""

    first_batch: int
    first: MemoryTimeline
    second_batch: int
    second: MemoryTimeline
    # cuda: the caching allocator's configuration, whose rounding every size gets; cpu: None
    allocator: AllocatorConfig | None

    @classmethod
    def fit(
        cls,
        first: tuple[int, MemoryTimeline],
        second: tuple[int, MemoryTimeline],
        allocator: AllocatorConfig | None,
    ) -> BatchLines | None:
        """None where the two timelines differ in anything but sizes (no lines to draw)."""
        (first_batch, first_timeline), (second_batch, second_timeline) = sorted([first, second], key=lambda p: p[0])
        if first_batch == second_batch or not _same_shape(first_timeline, second_timeline):
            return None
        return cls(first_batch, first_timeline, second_batch, second_timeline, allocator)

    def timeline_at(self, batch: int) -> MemoryTimeline | None:
        """None where some request would not be a whole, non-negative number of bytes."""
        allocations = []
        for a, b in zip(self.first.allocations, self.second.allocations, strict=True):
            if a.sized_call is not None and b.sized_call is not None:
                # A reduction's staging or the embedding backward's is not affine in the batch; what the kernel
                # works on is: size it anew.
                sized_call = self._sized_call_at(a.sized_call, b.sized_call, batch)
                a = replace(a, sized_call=sized_call)
                scaled = None if sized_call is None else sized_call.bytes()
            else:
                scaled = self._on_line(_requested(a), _requested(b), batch)
            if scaled is None:
                return None
            size = round_size(scaled, self.allocator) if self.allocator is not None and scaled else scaled
            allocations.append(replace(a, size_bytes=size, requested_bytes=scaled))
        return replace(self.first, allocations=tuple(allocations))

    def _on_line(self, low: int, high: int, batch: int) -> int | None:
        """The value at `batch` on the line through (first_batch, low) and (second_batch, high);
        None where that is not a whole, non-negative number."""
        span = self.second_batch - self.first_batch
        value, remainder = divmod(low * span + (high - low) * (batch - self.first_batch), span)
        return None if remainder or value < 0 else value

    def _sized_call_at(self, first: SizedCall, second: SizedCall, batch: int) -> SizedCall | None:
        """The call at `batch`: its scaled fields on their lines, the rest as traced; None where the rest differs
        or a scaled field is off its line or 0 there (nothing to work on: a trace says what the kernel does). A
        call may take another path of its kernel there: its parts are the same at every size, 0 bytes where that
        path makes no such request (memplan.estimator.cuda.embedding_backward)."""
        scaled = {name: 0 for name in first.SCALED_FIELDS}
        if type(first) is not type(second) or replace(first, **scaled) != replace(second, **scaled):  # type: ignore[type-var]
            return None
        for name in first.SCALED_FIELDS:
            value = self._on_line(getattr(first, name), getattr(second, name), batch)
            if not value:
                return None
            scaled[name] = value
        return replace(first, **scaled)  # type: ignore[type-var]


def same_requests(first: MemoryTimeline, second: MemoryTimeline) -> bool:
    """The same requests, in the same order, of the same sizes, made and freed at the same nodes."""
    return _same_shape(first, second) and all(
        a.size_bytes == b.size_bytes for a, b in zip(first.allocations, second.allocations, strict=True)
    )


def fit_bytes(timeline: MemoryTimeline, settings: TrainingSettings) -> int:
    """What a budget must hold, as Simulation.fit_bytes: on cuda the least device memory the
    iteration completes in across the cuDNN workspace band (device_fit_bytes), else the peak."""
    if settings.device != "cuda":
        return max(timeline.total_bytes())
    return device_fit_bytes(timeline, settings.allocator_config)


def fits(timeline: MemoryTimeline, settings: TrainingSettings, budget_bytes: int) -> bool:
    """As Simulation.fits_within: on cuda the step completes on a device of the budget's size, else its peak fits."""
    if settings.device != "cuda":
        return max(timeline.total_bytes()) <= budget_bytes
    return fits_within(timeline, budget_bytes, settings.allocator_config)


def phase_fit_bytes(timeline: MemoryTimeline, settings: TrainingSettings) -> dict[str, int]:
    """As Simulation.fit_phase_peaks: one "device" figure on cuda, else each phase's peak."""
    if settings.device == "cuda":
        return {"device": fit_bytes(timeline, settings)}
    totals = timeline.total_bytes()
    starts = timeline.phase_starts()
    ends = [starts["backward"], starts["optimizer"], timeline.node_count]
    return {phase: max(totals[start:end], default=0) for (phase, start), end in zip(starts.items(), ends, strict=True)}
