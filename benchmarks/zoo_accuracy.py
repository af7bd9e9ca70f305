"""Print the accuracy zoo as a markdown table: predicted vs measured peak on a real CPU run.

Usage: python benchmarks/zoo_accuracy.py   (from the repository root)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.trace import trace_step  # noqa: E402
from memplan.measure.cpu import measure_cpu  # noqa: E402
from memplan.models.source import resolve_model  # noqa: E402
from tests.zoo import TINY_HF_CONFIGS, ZOO_CASES, write_tiny_config  # noqa: E402


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    print("| case | settings | predicted (B) | measured (B) | error |")
    print("| --- | --- | ---: | ---: | ---: |")
    for case in ZOO_CASES:
        model = write_tiny_config(case.model, folder) if case.model in TINY_HF_CONFIGS else case.model
        spec = resolve_model(model, inputs=case.inputs, loss=case.loss)
        settings = spec.settings_for(case.settings)
        predicted = simulate(trace_step(spec, settings)).peak_bytes
        measured = measure_cpu(spec, settings).peak_bytes
        s = settings
        checkpoint = s.checkpoint if isinstance(s.checkpoint, str) else "one segment of all blocks"
        described = f"b{s.batch_size} {s.precision} {s.optimizer} accum {s.grad_accum} ckpt {checkpoint}"
        error = (predicted - measured) / measured
        print(f"| {case.id} | {described} | {predicted:,} | {measured:,} | {error:+.4%} |", flush=True)


if __name__ == "__main__":
    main()
