"""Does every preset trace on the cuda target, on every precision, GPU and checkpoint setting?

Usage (from the repository root):
  python benchmarks/cuda_matrix.py            # the presets' architectures shrunk (tests/zoo.py), full product
  python benchmarks/cuda_matrix.py --real     # the presets themselves at batch 1, sequence 128 (slow)

Prints one markdown row per configuration (peak and reserved peak, or the error) and a count of
failures at the end; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan.errors import MemplanError, UsageError  # noqa: E402
from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.trace import trace_step  # noqa: E402
from memplan.models.presets import all_presets  # noqa: E402
from memplan.models.source import resolve_model  # noqa: E402
from memplan.settings import PRECISIONS, TrainingSettings  # noqa: E402
from memplan.sizes import format_bytes  # noqa: E402
from tests.zoo import tiny_preset_config  # noqa: E402

GPUS = ("H100-80GB", "A100-80GB", "A10G", "T4", "V100-32GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="the presets at their real sizes (batch 1, seq 128)")
    arguments = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    failures = 0
    started = time.perf_counter()
    print("| preset | precision | gpu | checkpoint | peak | reserved | result |")
    print("| --- | --- | --- | --- | ---: | ---: | --- |")
    for name, preset in all_presets().items():
        model = name
        if not arguments.real:
            (folder / name).mkdir()
            (folder / name / "config.json").write_text(json.dumps(tiny_preset_config(preset)))
            model = str(folder / name)
        shape = {"image_size": 224 if arguments.real else 32} if preset.task == "image-classification" else {}
        shape = shape or {"seq_len": 128 if arguments.real else 32}
        spec = resolve_model(model, task=preset.task)
        for precision in PRECISIONS:
            for gpu in GPUS:
                for checkpoint in ("none", "all"):
                    settings = TrainingSettings(
                        batch_size=1, precision=precision, gpu=gpu, checkpoint=checkpoint, **shape
                    )
                    try:
                        simulation = simulate(trace_step(spec, spec.settings_for(settings)))
                    except UsageError as error:  # a combination memplan refuses up front, with a reason
                        print(f"| {name} | {precision} | {gpu} | {checkpoint} | | | refused: {error} |", flush=True)
                        continue
                    except MemplanError as error:
                        failures += 1
                        print(f"| {name} | {precision} | {gpu} | {checkpoint} | | | FAILED: {error} |", flush=True)
                        continue
                    result = "ok" if not simulation.unsupported_ops else f"unsupported: {simulation.unsupported_ops}"
                    peak, reserved = simulation.peak_bytes, simulation.reserved_peak_bytes or 0
                    row = f"| {name} | {precision} | {gpu} | {checkpoint} | {format_bytes(peak)} | "
                    print(row + f"{format_bytes(reserved)} | {result} |", flush=True)
    print(f"\n{failures} failed; {time.perf_counter() - started:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
