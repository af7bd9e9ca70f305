"""memplan's cuda predictions beside training-memory figures people measured on real GPUs and published.

Usage (from the repository root):  python benchmarks/published.py [ID ...]

The measurements are in benchmarks/published.json: each with its source, the exact quote, the
settings as the source states them, which figure it is (nvidia-smi, max_memory_reserved or
max_memory_allocated) and memplan's reading of those settings ("memplan"), with the caveats where
the two cannot match exactly. Nothing in memplan was fitted to these rows: they are all a check.
The one number taken from a source is a CUDA context the same source measured (the HF docs'
`torch.ones((1, 1)).to("cuda")` step), passed as --cuda-context would be.

Prints one markdown row per measurement and the median and worst error per figure.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.utils import logging  # noqa: E402

from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.trace import trace_step  # noqa: E402
from memplan.models.source import resolve_model  # noqa: E402
from memplan.settings import TrainingSettings  # noqa: E402

MiB = 1 << 20
DATA = Path(__file__).with_name("published.json")


def predict(row: dict, folder: Path) -> dict[str, float]:
    """memplan's allocated, reserved and device figures for the row, in MiB (one trace)."""
    memplan = dict(row["memplan"])
    model = memplan.pop("model", None)
    config = memplan.pop("config", None)
    if config is not None:
        (folder / row["id"]).mkdir()
        (folder / row["id"] / "config.json").write_text(json.dumps(config))
        model = str(folder / row["id"])
    task = memplan.pop("task")
    context_mib = memplan.pop("cuda_context_mib", None)
    if context_mib is not None:
        memplan["cuda_context"] = int(context_mib * MiB)
    spec = resolve_model(model, task=task)
    settings = spec.settings_for(TrainingSettings(**memplan))
    simulation = simulate(trace_step(spec, settings))
    return {
        "max_memory_allocated": simulation.peak_bytes / MiB,
        "max_memory_reserved": simulation.reserved_peak_bytes / MiB,
        "nvidia-smi": (simulation.reserved_peak_bytes + settings.context_bytes) / MiB,
    }


def main() -> None:
    logging.set_verbosity_error()
    rows = json.loads(DATA.read_text())
    wanted = set(sys.argv[1:])
    folder = Path(tempfile.mkdtemp())
    errors: dict[str, list[float]] = {}
    print("| id | GPU | figure | measured (MiB) | predicted (MiB) | error |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for row in rows:
        if wanted and row["id"] not in wanted:
            continue
        predicted = predict(row, folder)[row["figure"]]
        error = (predicted - row["measured_mib"]) / row["measured_mib"]
        errors.setdefault(row["figure"], []).append(error)
        gpu = row["memplan"]["gpu"]
        print(
            f"| {row['id']} | {gpu} | {row['figure']} | {row['measured_mib']:,.0f} | {predicted:,.0f} | {error:+.1%} |",
            flush=True,
        )
    print()
    for figure, values in errors.items():
        absolute = [abs(value) for value in values]
        print(
            f"{figure}: {len(values)} rows, median |error| {statistics.median(absolute):.1%}, "
            f"worst {max(values, key=abs):+.1%}, under-predicted {sum(value < 0 for value in values)}"
        )


if __name__ == "__main__":
    main()
