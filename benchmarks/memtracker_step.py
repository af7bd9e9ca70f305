"""The same training step under PyTorch's MemTracker with fake tensors (for comparison with memplan).

Usage: python benchmarks/memtracker_step.py  (gpt2, batch 8, seq 1024, AdamW foreach, fp32)
Prints MemTracker's peak (bytes) for the CUDA-less fake run; timed as a whole process by bench_estimate.py.
"""

from __future__ import annotations

import time

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from memplan.estimator.fake_mode import constant_item
from memplan.estimator.hf_patches import no_weight_init
from memplan.estimator.loop import iteration, prepare
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings


def main() -> None:
    started = time.perf_counter()
    spec = resolve_model("gpt2")
    settings = spec.settings_for(TrainingSettings(batch_size=8, seq_len=1024, device="cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True), constant_item(), no_weight_init():
        state = prepare(spec, settings)
        iteration(state)  # creates the optimizer state
        tracker = MemTracker()
        tracker.track_external(state.model, state.optimizer)
        with tracker:
            iteration(state)
        peak_by_device = tracker.get_tracker_snapshot("peak")
    total = max(stats.get("Total", 0) for stats in peak_by_device.values())
    print(f"memtracker peak_bytes={total} seconds_in_process={time.perf_counter() - started:.2f}")


if __name__ == "__main__":
    main()
