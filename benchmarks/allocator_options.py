"""The caching allocator's options on memplan's own predicted steps: reserved and the smallest device.

Usage (from the repository root):  python benchmarks/allocator_options.py [--skip-qwen]

For each model (cuda target, the default H100, fp32 AdamW), one estimate with the default
allocator and one with `expandable_segments:True`, each giving the allocated peak, the reserved
peak and `smallest_device_bytes`: the least memory (for torch) the step completes in when the
allocator, short of memory, frees its cached segments (or unmaps its free pages) and retries.
Percentages are against the default allocator's reserved peak. These are replays of memplan's
simulator, not GPU measurements; the table in docs/validation.md comes from this script.

The last column replays the same request sequences through tests/reference_allocator.py, an
independent implementation of CUDACachingAllocator.cpp's rules, and says whether its reserved
peaks and smallest devices (bisected the same way) equal memplan's, or by how much they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.utils import logging  # noqa: E402

import memplan  # noqa: E402
from memplan.estimator.result import EstimateResult  # noqa: E402
from tests.reference_replay import recorded_requests, reference_replay, reference_smallest_device  # noqa: E402

CASES = [
    ("gpt2", "gpt2 b8 × 1024", {"batch_size": 8, "seq_len": 1024}),
    ("qwen2.5-0.5b", "Qwen2.5-0.5B b4 × 2048", {"batch_size": 4, "seq_len": 2048}),
    ("resnet-50", "ResNet-50 b64", {"batch_size": 64}),
]
GIB = 1 << 30


def _cell(value: int, reference: int) -> str:
    return f"{value / GIB:.2f} GiB ({(value - reference) / reference:+.1%})"


def _reference_check(result: EstimateResult, expandable: bool) -> str:
    """'equal', or how the reference's reserved peak and smallest device differ from memplan's."""
    assert result.timeline is not None and result.reserved_peak_bytes is not None
    calls = recorded_requests(result.timeline)
    reserved = reference_replay(calls, expandable, None).max_reserved_bytes
    allocated = max(result.timeline.total_bytes())
    smallest = reference_smallest_device(calls, expandable, allocated, reserved)
    # memplan's smallest device is the larger of its cuDNN band's ends: compare the band's top with
    # the reference where a band exists (the same requests).
    ours = result.reserved_peak_bytes, _top_end_smallest(result, expandable)
    if (reserved, smallest) == ours:
        return "equal"
    return f"reference {reserved / GIB:.3f} / {smallest / GIB:.3f} GiB"


def _top_end_smallest(result: EstimateResult, expandable: bool) -> int:
    from memplan.estimator.cuda.allocator import AllocatorConfig
    from memplan.estimator.timeline import smallest_device_bytes

    assert result.timeline is not None and result.reserved_peak_bytes is not None
    config = AllocatorConfig(expandable_segments=expandable)
    allocated = max(result.timeline.total_bytes())
    return smallest_device_bytes(result.timeline, allocated, result.reserved_peak_bytes, config)


def main() -> None:
    logging.set_verbosity_error()
    skip_qwen = "--skip-qwen" in sys.argv
    print(
        "| model | allocated | reserved, default | smallest device, default | reserved, expandable segments "
        "| smallest device, expandable segments | independent replay (default; expandable) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for model, label, settings in CASES:
        if skip_qwen and model.startswith("qwen"):
            continue
        default = memplan.estimate(model, **settings)
        expandable = memplan.estimate(model, cuda_alloc_conf="expandable_segments:True", **settings)
        reserved = default.reserved_peak_bytes
        assert reserved is not None and expandable.reserved_peak_bytes is not None
        assert default.smallest_device_bytes is not None and expandable.smallest_device_bytes is not None
        print(
            f"| {label} | {default.peak_bytes / GIB:.2f} GiB | {reserved / GIB:.2f} GiB | "
            f"{_cell(default.smallest_device_bytes, reserved)} | {_cell(expandable.reserved_peak_bytes, reserved)} | "
            f"{_cell(expandable.smallest_device_bytes, reserved)} | "
            f"{_reference_check(default, False)}; {_reference_check(expandable, True)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
