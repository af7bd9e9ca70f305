"""A warm trace's CPU time with memplan's fake-tensor cache keys and cached outputs (memplan.estimator.fake_cache_keys,
memplan.estimator.fake_cache_outputs) and with torch's own functions, alternately in one process, over the same model,
settings and fake setup.

Usage: python benchmarks/fake_cache.py [MODEL ...] [--rounds N]   (default: gpt2 resnet-50, 8 rounds)
gpt2 is traced at -b 8 --seq-len 1024, anything else at -b 8 and its own defaults. Three variants, one trace each per
round, in an order that rotates from round to round: torch's `_prep_args_for_hash` and
`_get_output_tensor_from_cache_entry` ("torch"), memplan's keys with torch's outputs ("keys"), memplan's keys and
outputs ("keys+outputs", what memplan runs). Prints, per model, the smallest and the median `time.process_time()` of a
trace with each, and each one's peak; exits with an error where the peaks differ. The objects made
before the rounds are frozen (gc.freeze), as the command line freezes what its imports made.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["gpt2", "resnet-50"])
    parser.add_argument("--rounds", type=int, default=8)
    options = parser.parse_args()

    from torch._subclasses.fake_tensor import FakeTensorMode
    from warm_trace import warm_setup  # (benchmarks/, the script's own folder)

    from memplan.estimator import fake_mode
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step

    mode = fake_mode.TracingFakeMode
    keys = {"torch": FakeTensorMode._prep_args_for_hash, "memplan": mode._prep_args_for_hash}
    outputs = {
        "torch": FakeTensorMode._get_output_tensor_from_cache_entry,
        "memplan": mode._get_output_tensor_from_cache_entry,
    }
    variants = {"torch": ("torch", "torch"), "keys": ("memplan", "torch"), "keys+outputs": ("memplan", "memplan")}
    for name in options.models:
        spec, settings, setup = warm_setup(name)
        trace_step(spec, settings, setup, None)  # the fake-tensor cache warmed
        gc.freeze()
        seconds: dict[str, list[float]] = {variant: [] for variant in variants}
        peaks: dict[str, int] = {}
        try:
            order = list(variants)
            for round_number in range(options.rounds):
                shift = round_number % len(order)  # each variant in each position as often (a position's bias)
                for variant in order[shift:] + order[:shift]:
                    key_s, output_s = variants[variant]
                    mode._prep_args_for_hash = keys[key_s]  # type: ignore[method-assign]
                    mode._get_output_tensor_from_cache_entry = outputs[output_s]  # type: ignore[method-assign]
                    started = time.process_time()
                    traced = trace_step(spec, settings, setup, None)
                    seconds[variant].append(time.process_time() - started)
                    peaks[variant] = simulate(traced).peak_bytes
        finally:
            mode._prep_args_for_hash = keys["memplan"]  # type: ignore[method-assign]
            mode._get_output_tensor_from_cache_entry = outputs["memplan"]  # type: ignore[method-assign]
            gc.unfreeze()
        if len(set(peaks.values())) != 1:
            raise SystemExit(f"{name}: the variants' peaks differ: {peaks}")
        print(
            json.dumps(
                {
                    "model": name,
                    "rounds": options.rounds,
                    "trace_cpu_s": {
                        variant: {"min": round(min(times), 3), "median": round(statistics.median(times), 3)}
                        for variant, times in seconds.items()
                    },
                    "peak_bytes": peaks,
                }
            )
        )


if __name__ == "__main__":
    main()
