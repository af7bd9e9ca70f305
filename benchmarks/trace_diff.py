"""Set memplan's predicted allocator events beside those a real GPU iteration made.

    python benchmarks/trace_diff.py docs/validation/h100/traces-main.tar.gz CONFIG_ID [--gpu H100-80GB]

The measured side is one entry of the traces archive `gpu_evidence.py measure` writes (the
measured iteration's alloc/free events, no stacks, and the segments at its end); the predicted
side is memplan's replay of the same configuration's timeline (the last steady-state iteration).
Printed: how many requests each made, the request sizes only one side made (by size, with
counts), and the segments each side holds. What differs is where a reserved-peak miss comes from.

`--replay` also feeds the run's own requests to memplan's allocator simulator: memplan's own first
iteration (what persists, the optimizer state at its first step, the cuBLAS workspaces at their
threads' first matmuls), then the measured iteration's allocs and frees for the other two, as
memplan replays its own. Beside memplan's reserved peak and the run's, it tells a miss in the
requests (the run's requests replay close to the run) from one in the layout the warm-ups left.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 2**20


def measured_events(archive: Path, config_id: str) -> dict:
    with tarfile.open(archive) as tar:
        return json.load(tar.extractfile(f"{config_id}.json"))  # type: ignore[arg-type]


def predicted(config_id: str, gpu: str) -> tuple[list[tuple[str, int]], list[int], object]:
    import memplan
    from memplan.estimator.cuda.allocator import CachingAllocator
    from memplan.estimator.timeline import replay_steady_state
    from memplan.validate.suite import SUITES

    config = next(c for suite in SUITES.values() for c in suite if c.id == config_id)
    result = memplan.estimate(config.model, inputs=config.inputs, device="cuda", gpu=gpu, **config.settings)
    events: list[tuple[str, int]] = []
    allocator = CachingAllocator(result.settings.allocator_config)

    def on_event(action: str, handle: int, allocation: object) -> None:
        if action in ("alloc", "free"):  # torch's trace records the size asked for, before rounding
            events.append((action, allocation.requested_bytes or allocation.size_bytes))  # type: ignore[attr-defined]

    replay_steady_state(result.timeline, allocator, on_event)  # type: ignore[arg-type]
    segments = [segment[1] for segment in allocator.segment_layout()]
    return events, segments, result


def replay_measured(real: dict, result: object) -> int:
    """memplan's simulator's reserved peak over the run's measured-iteration requests (see --replay)."""
    from memplan.estimator import timeline as timelines
    from memplan.estimator.cuda.allocator import CachingAllocator

    allocator = CachingAllocator(result.settings.allocator_config)  # type: ignore[attr-defined]
    # memplan's own first iteration: what persists, the optimizer state at the first step and the
    # cuBLAS workspaces at their threads' first matmuls, where that iteration leaves them.
    timelines.replay_steady_state(result.timeline, allocator, iterations=1)  # type: ignore[attr-defined]
    iterations = timelines.STEADY_STATE_ITERATIONS
    events = [(action, address, size) for action, address, size, _ in real["events"]]
    for _ in range(iterations - 1):
        allocator.reset_peak_stats()
        handles: dict[int, int] = {}
        for action, address, size in events:
            if action == "alloc":
                handles[address] = allocator.malloc(max(size, 1))
            elif action == "free_completed" and address in handles:
                allocator.free(handles.pop(address))
    return allocator.max_reserved_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive", type=Path)
    parser.add_argument("config")
    parser.add_argument("--gpu", default="H100-80GB")
    parser.add_argument("--replay", action="store_true", help="replay the run's own requests (docstring)")
    arguments = parser.parse_args()
    real = measured_events(arguments.archive, arguments.config)
    real_allocs = [size for action, _, size, _ in real["events"] if action == "alloc"]
    ours, our_segments, result = predicted(arguments.config, arguments.gpu)
    our_allocs = [size for action, size in ours if action == "alloc"]
    print(f"requests: measured {len(real_allocs)}, predicted {len(our_allocs)}")
    print(f"bytes requested: measured {sum(real_allocs) / MiB:.1f} MiB, predicted {sum(our_allocs) / MiB:.1f} MiB")
    real_count = collections.Counter(real_allocs)
    our_count = collections.Counter(our_allocs)
    only_real = real_count - our_count
    only_ours = our_count - real_count
    print("sizes only measured (MiB x count):", [(round(s / MiB, 3), n) for s, n in sorted(only_real.items())][-25:])
    print("sizes only predicted (MiB x count):", [(round(s / MiB, 3), n) for s, n in sorted(only_ours.items())][-25:])
    real_segments = sorted(segment[0] for segment in real["segments"])
    print(
        f"segments: measured {len(real_segments)} = {sum(real_segments) / MiB:.0f} MiB; "
        f"predicted {len(our_segments)} = {sum(our_segments) / MiB:.0f} MiB"
    )
    print("largest measured:", [round(s / MiB, 1) for s in real_segments[-12:]])
    print("largest predicted:", [round(s / MiB, 1) for s in sorted(our_segments)[-12:]])
    other = collections.Counter(a for a, *_ in real["events"])
    print("measured actions:", dict(other))
    if arguments.replay:
        GiB = 2**30
        print(
            f"reserved: the run's segments {sum(real_segments) / GiB:.2f} GiB; memplan's requests "
            f"{result.reserved_peak_bytes / GiB:.2f} GiB; the run's requests through memplan's simulator "
            f"{replay_measured(real, result) / GiB:.2f} GiB"
        )


if __name__ == "__main__":
    main()
