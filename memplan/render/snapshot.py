"""The predicted iteration as a `torch.cuda.memory._snapshot()` pickle, for PyTorch's memory_viz.

`python -m torch.cuda._memory_viz trace_plot FILE -o page.html` draws it like a measured snapshot
(`memplan validate --snapshot`), so the two can be put side by side. The format follows
torch/cuda/memory.py's `_snapshot` docstring and what torch/utils/viz/MemoryViz.js reads:
`segments` is the allocator's state after the iteration (each with its blocks, in address order),
`device_traces[0]` the iteration's events: `segment_alloc`, `alloc`, `free_requested` and
`free_completed`, each with `addr`, `size`, `stream` and `frames`.

Addresses come from memplan's caching-allocator simulator replaying the steady-state iteration
(memplan.estimator.timeline.replay_steady_state). A "frame" names what made the tensor: the
module as the file, the graph node as the line, and the aten op with memplan's category as the
function. Event `category` fields are left out: MemoryViz.js (torch 2.x) fails on categories
without an "unknown" one.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from memplan.estimator.cuda.allocator import CachingAllocator
from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation, replay_steady_state
from memplan.outputs import write_atomically

# Where the simulated device memory starts; a CUDA-like address, so no block sits at address 0.
BASE_ADDRESS = 0x7F0000000000


def _frames(allocation: TimelineAllocation) -> list[dict[str, Any]]:
    return [
        {
            "filename": allocation.module or "(no module)",
            "line": allocation.allocated_at,
            "name": f"{allocation.op} [{allocation.category}]",
        }
    ]


def predicted_snapshot(timeline: MemoryTimeline, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The steady-state iteration's events and the allocator's state after it, as memory_viz reads them."""
    allocator = CachingAllocator()
    events: list[dict[str, Any]] = []
    persistent: dict[int, TimelineAllocation] = {}  # handle -> what lives through the iteration
    live: dict[int, tuple[int, TimelineAllocation]] = {}  # handle -> (address, allocation), recorded iteration
    segments_seen = 0

    def on_last_iteration() -> None:
        nonlocal segments_seen
        segments_seen = allocator.segments

    def on_event(action: str, handle: int, allocation: TimelineAllocation) -> None:
        nonlocal segments_seen
        if action == "persistent":
            persistent[handle] = allocation
        elif action == "alloc":
            if allocator.segments > segments_seen:  # this request made the allocator cudaMalloc
                for address, size, _, _ in allocator.segment_layout()[segments_seen:]:
                    events.append(_event("segment_alloc", address, size, [], allocation.stream))
                segments_seen = allocator.segments
            live[handle] = (allocator.block(handle)[0], allocation)
            events.append(
                _event("alloc", live[handle][0], allocation.size_bytes, _frames(allocation), allocation.stream)
            )
        else:
            address, allocation = live.pop(handle)
            for freed in ("free_requested", "free_completed"):
                events.append(_event(freed, address, allocation.size_bytes, _frames(allocation), allocation.stream))

    replay_steady_state(timeline, allocator, on_event, on_last_iteration)
    return {
        "segments": [_segment(*layout, persistent) for layout in allocator.segment_layout()],
        "device_traces": [events],
        "allocator_settings": {},
        "memplan": {"kind": "predicted", **(metadata or {})},
    }


def _event(action: str, address: int, size: int, frames: list[dict[str, Any]], stream: int) -> dict[str, Any]:
    return {"action": action, "addr": BASE_ADDRESS + address, "size": size, "stream": stream, "frames": frames}


def _segment(
    address: int,
    size: int,
    small: bool,
    blocks: list[tuple[int, int, int | None]],
    persistent: dict[int, TimelineAllocation],
) -> dict[str, Any]:
    """A segment after the iteration: its allocated blocks are the persistent allocations."""
    rendered = [
        {
            "address": BASE_ADDRESS + block_address,
            "size": block_size,
            "requested_size": persistent[handle].size_bytes if handle is not None else 0,
            "state": "active_allocated" if handle is not None else "inactive",
            "frames": _frames(persistent[handle]) if handle is not None else [],
        }
        for block_address, block_size, handle in blocks
    ]
    active = [block for block in rendered if block["state"] == "active_allocated"]
    allocated = sum(block["size"] for block in active)
    return {
        "device": 0,
        "address": BASE_ADDRESS + address,
        "total_size": size,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(block["requested_size"] for block in active),
        "stream": 0,
        "segment_type": "small" if small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": rendered,
    }


def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> None:
    write_atomically(path, lambda file: pickle.dump(snapshot, file), "snapshot")
