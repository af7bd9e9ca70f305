"""How long planning takes beyond the first trace, on a 48-block model (issue 4 target: under 10 s).

Run: python benchmarks/bench_plan.py
Timings on a shared 2-core VM vary by +-30% from run to run: run it three times and take the median.
A GPT-2-shaped model with 48 blocks (width 256, 4 heads), batch 4, seq 256, fp32, AdamW,
target cpu; the budget is half-way between checkpointing all blocks and none.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from memplan.estimator.trace import build_fake_setup, trace_step
from memplan.forked import available_cores
from memplan.models.source import resolve_model
from memplan.planner.plan import make_plan
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes

CONFIG = {
    "model_type": "gpt2",
    "n_embd": 256,
    "n_layer": 48,
    "n_head": 4,
    "n_positions": 512,
    "vocab_size": 4096,
    "architectures": ["GPT2LMHeadModel"],
}


def main() -> None:
    folder = Path(tempfile.mkdtemp()) / "gpt2-48"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    spec = resolve_model(str(folder))
    settings = spec.settings_for(TrainingSettings(batch_size=4, seq_len=256, device="cpu"))

    started = time.perf_counter()
    traced = trace_step(spec, settings, build_fake_setup(spec, settings))
    first_trace = time.perf_counter() - started
    recorded = len(traced.optimizer_recording.ops) if traced.optimizer_recording else 0

    probe = make_plan(spec, settings, 1 << 40)
    peaks = {option.name: option.predicted_peak_bytes for option in probe.baselines}
    budget = (peaks["all blocks"] + peaks["none"]) // 2

    started = time.perf_counter()
    steps: list[tuple[float, str]] = []
    result = make_plan(spec, settings, budget, progress=lambda m: steps.append((time.perf_counter() - started, m)))
    total = time.perf_counter() - started
    own_first_trace = next(at for at, message in steps if message.startswith("solving"))
    print(f"cores: {available_cores()} (the plan's layouts are traced in that many processes)")
    print(f"first trace (build + trace, no checkpointing): {first_trace:.1f} s")
    nodes = len(traced.graph.nodes)
    print(f"  {nodes:,} graph nodes; the optimizer step's {recorded:,} ops are replayed in later traces")
    print(f"whole plan: {total:.1f} s in {result.traces} traces; beyond the first trace: {total - first_trace:.1f} s")
    print(f"  after the plan's own first trace (solve, trace the layouts, choose): {total - own_first_trace:.1f} s")
    for at, message in steps:
        print(f"  {at:6.1f} s  {message}")
    print(
        f"budget {format_bytes(budget)}: plan {result.layout.describe()}, "
        f"peak {format_bytes(result.predicted_peak_bytes)}"
    )
    for option in result.baselines:
        print(
            f"  {option.name:18s} {format_bytes(option.predicted_peak_bytes):>12s} recompute {option.recompute_flops:,}"
        )


if __name__ == "__main__":
    main()
