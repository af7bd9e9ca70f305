"""A warm trace's CPU time, per model: what a change to the tracer saves, compared across two trees.

Usage: PYTHONPATH=<tree> python benchmarks/warm_trace.py [MODEL ...] [--rounds N]   (default: gpt2 resnet-50, 8 rounds)
gpt2 is traced at -b 8 --seq-len 1024, anything else at -b 8 and its own defaults, on memplan's default (cuda) target.
After one trace that warms the fake-tensor cache, prints per model the smallest and the median `time.process_time()`
of a trace, the peak (which a change for speed must leave equal), and the median CPU time of the trace's calls of
torch's `_group_tensors_by_device_and_dtype` (a foreach optimizer's step groups every parameter, gradient and state
tensor by device and dtype, one fake device query each: memplan.estimator.held_tensors.OptimizerLocals answers those
at once since faf0cce). Run it in the tree before a change and in the
tree after it alternately (`git worktree add /tmp/before <commit>`): this machine's speed drifts by more than the
changes measured. The objects made before the rounds are frozen (gc.freeze), as the command line freezes its imports'.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


def warm_setup(name: str) -> tuple:
    """The model's spec, its settings (gpt2: -b 8 --seq-len 1024; any other: -b 8 and its defaults) and its fake setup,
    transformers imported first, as an estimate imports it (this script's and benchmarks/fake_cache.py's)."""
    import transformers  # noqa: F401

    from memplan.estimator.trace import build_fake_setup
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings

    spec = resolve_model(name)
    chosen = TrainingSettings(batch_size=8, seq_len=1024) if name == "gpt2" else TrainingSettings(batch_size=8)
    settings = spec.settings_for(chosen)
    return spec, settings, build_fake_setup(spec, settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["gpt2", "resnet-50"])
    parser.add_argument("--rounds", type=int, default=8)
    options = parser.parse_args()

    import torch

    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step

    grouping_s = [0.0]
    torch_s_grouping = torch._C._group_tensors_by_device_and_dtype

    def timed_grouping(*args: object) -> object:
        started = time.process_time()
        try:
            return torch_s_grouping(*args)
        finally:
            grouping_s[0] += time.process_time() - started

    torch._C._group_tensors_by_device_and_dtype = timed_grouping  # (torch/utils/_foreach_utils.py looks it up there)
    for name in options.models:
        spec, settings, setup = warm_setup(name)
        peak = simulate(trace_step(spec, settings, setup, None)).peak_bytes  # the fake-tensor cache warmed
        gc.freeze()
        seconds, grouping = [], []
        try:
            for _ in range(options.rounds):
                grouping_s[0] = 0.0
                started = time.process_time()
                trace_step(spec, settings, setup, None)
                seconds.append(time.process_time() - started)
                grouping.append(grouping_s[0])
        finally:
            gc.unfreeze()
        print(
            json.dumps(
                {
                    "model": name,
                    "rounds": options.rounds,
                    "trace_cpu_s": {"min": round(min(seconds), 3), "median": round(statistics.median(seconds), 3)},
                    "peak_bytes": peak,
                    "optimizer_device_grouping_cpu_ms": round(1000 * statistics.median(grouping), 1),
                }
            )
        )


if __name__ == "__main__":
    main()
