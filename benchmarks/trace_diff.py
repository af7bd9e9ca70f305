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

`--float32-build` replays memplan's requests after the weights were built in float32 on the GPU
and cast to their storage dtype, as the H100 run's harness built its bf16 models (it now builds
them in that dtype from the start, as memplan predicts).
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


def reserved_after_float32_build(result: object) -> int:
    """memplan's reserved peak had the weights been built in float32 on the GPU and then cast to their
    storage dtype one by one (`model.cuda().bfloat16()`; the H100 run's harness did this): each float32
    weight allocated in order, then each cast copy allocated and its float32 original freed, then the
    step replayed as usual on the allocator that build left. (Tied weights are freed at their own
    turn here, where a real cast keeps the original until the last module sharing it is cast.)"""
    from dataclasses import replace

    from memplan.estimator.cuda.allocator import CachingAllocator
    from memplan.estimator.timeline import replay_steady_state

    timeline = result.timeline  # type: ignore[attr-defined]
    end = timeline.node_count
    weights = [a for a in timeline.allocations if a.persists(end) and a.category == "parameters" and a.size_bytes]
    widening = 4 // {"bf16": 2, "fp16": 2}.get(result.settings.precision, 4)  # type: ignore[attr-defined]
    if widening == 1:
        return result.reserved_peak_bytes  # type: ignore[attr-defined]  # float32 weights: nothing is cast
    allocator = CachingAllocator(result.settings.allocator_config)  # type: ignore[attr-defined]
    built = [allocator.malloc(widening * (weight.requested_bytes or weight.size_bytes)) for weight in weights]
    for weight, original in zip(weights, built, strict=True):
        allocator.malloc(weight.size_bytes)
        allocator.free(original)
    rest = tuple(allocation for allocation in timeline.allocations if allocation not in weights)
    replay_steady_state(replace(timeline, allocations=rest), allocator)
    return allocator.max_reserved_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive", type=Path)
    parser.add_argument("config")
    parser.add_argument("--gpu", default="H100-80GB")
    parser.add_argument("--replay", action="store_true", help="replay the run's own requests (docstring)")
    parser.add_argument(
        "--float32-build", action="store_true", help="memplan's replay after a float32 build cast on the GPU"
    )
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

    if arguments.float32_build:
        GiB = 2**30
        print(
            f"reserved: the run's segments {sum(real_segments) / GiB:.3f} GiB; memplan's requests "
            f"{result.reserved_peak_bytes / GiB:.3f} GiB; the same after a float32 build cast on the GPU "
            f"{reserved_after_float32_build(result) / GiB:.3f} GiB"
        )


if __name__ == "__main__":
    main()
