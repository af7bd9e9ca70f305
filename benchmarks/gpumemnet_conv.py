"""memplan's cuda prediction beside GPUMemNet's conv-net runs on a real A100-SXM4-40GB.

The data (not shipped with memplan): itu-rad/GPUMemNet's CNN dataset as commit f5a3f5d has it
(`git show f5a3f5d:cnn_data_step1.csv`: at the repository's root then, under Datasets/CNN/ later;
2,061 runs; fp32, torch.optim.Adam, CrossEntropyLoss, random data; `Max GPU Memory (MiB)` is the
highest nvidia-smi memory.used polled every second over a 60 s run, so it holds the CUDA context
and what cuDNN keeps outside the caching allocator). The nets come from the dataset's own
generator; `--rebuild` names a module with `build_cnn(row)`, `batch(row, batch_size)` and
optionally `parse_filename(filename)` that rebuilds one from its row: benchmarks/gpumemnet_rebuild.py
follows the generator's code (cnn.py, launcher_cnn.py at f5a3f5d) and gives every run that lists
its layers the row's parameter counts, layer by layer.

Method: a seeded random sample of the successful runs and of the out-of-memory ones, each traced
once on the cuda target (`--gpu A100-40GB`, fp32, adam). The runs are split in two halves by a
hash of their file name. The one constant, the device's fixed part (context, cuDNN handles and
kernels: nvidia-smi minus the reserved peak), is the median over the calibration half's smallest
quarter; every error is then reported on both halves, the check half being the evidence.

usage: python benchmarks/gpumemnet_conv.py --data cnn_data_step1.csv --rebuild benchmarks/gpumemnet_rebuild.py
       [--successes 200] [--ooms 60] [--seed 1] [--out predictions.csv]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import random
import statistics
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from memplan.estimator.cuda.allocator import OutOfMemory  # noqa: E402
from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.timeline import reserved_peak_bytes  # noqa: E402
from memplan.estimator.trace import trace_step  # noqa: E402
from memplan.models.source import ModelRef, ModelSpec  # noqa: E402
from memplan.settings import TrainingSettings  # noqa: E402

MiB = 2**20
A100_40GB_MIB = 40960
COLUMNS = [
    "filename",
    "arch",
    "batchnorm",
    "batch",
    "status",
    "measured_mib",
    "reserved_low_mib",
    "reserved_mib",
    "card_reserved_mib",
]


def _load(path: str):
    spec = importlib.util.spec_from_file_location("gpumemnet_rebuild", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_spec(rebuild, row: dict) -> ModelSpec:
    loss = nn.CrossEntropyLoss()
    return ModelSpec(
        ModelRef(row["Filename"][:40]),
        lambda settings: rebuild.build_cnn(row),
        lambda settings, dtype: (rebuild.batch(row, settings.batch_size)[0],),
        lambda output, batch: loss(output, torch.zeros(batch[0].shape[0], dtype=torch.long)),
        lambda settings: settings,
    )


def predict(args: argparse.Namespace) -> list[dict]:
    rebuild = _load(args.rebuild)
    rows = list(csv.DictReader(open(args.data)))
    fields = [rebuild.parse_filename(row["Filename"]) if hasattr(rebuild, "parse_filename") else {} for row in rows]
    usable = [
        (row, field)
        for row, field in zip(rows, fields, strict=True)
        if row["Status"] in ("SUCCESSFUL", "OOM_CRASH") and field.get("input_size", 16) >= 16
    ]
    rng = random.Random(args.seed)
    success = [pair for pair in usable if pair[0]["Status"] == "SUCCESSFUL" and float(pair[0]["Max GPU Memory (MiB)"])]
    oom = [pair for pair in usable if pair[0]["Status"] == "OOM_CRASH"]
    sample = rng.sample(success, min(args.successes, len(success))) + rng.sample(oom, min(args.ooms, len(oom)))
    results = []
    for row, field in sample:
        settings = TrainingSettings(batch_size=int(row["Batch Size"]), optimizer="adam", gpu="A100-40GB")
        simulation = simulate(trace_step(_model_spec(rebuild, row), settings))
        low = simulation.conv_workspace_free_reserved_peak_bytes or simulation.reserved_peak_bytes
        result = {
            "filename": row["Filename"],
            "arch": field.get("arch"),
            "batchnorm": field.get("batchnorm"),
            "batch": settings.batch_size,
            "status": row["Status"],
            "measured_mib": float(row["Max GPU Memory (MiB)"]),
            "reserved_low_mib": low / MiB,
            "reserved_mib": simulation.reserved_peak_bytes / MiB,
        }
        result["timeline"] = simulation.timeline  # for the replay on the card (report); not written out
        result["allocator_config"] = simulation.allocator_config
        results.append(result)
        print(f"{len(results)}/{len(sample)}", result["arch"], result["batch"], result["status"], file=sys.stderr)
    return results


def on_the_card(results: list[dict], fixed_mib: float) -> None:
    """The band top's reserved peak replayed on the card itself: 40 GiB less the fixed part for torch,
    where the allocator releases its cache and retries, and cuDNN runs a plan without workspace where
    its workspace does not fit (memplan.estimator.timeline.reserved_peak_bytes). None: runs out."""
    capacity = int((A100_40GB_MIB - fixed_mib) * MiB)
    for result in results:
        try:
            reserved = reserved_peak_bytes(result["timeline"], result["allocator_config"], capacity)
        except OutOfMemory:
            result["card_reserved_mib"] = None
        else:
            result["card_reserved_mib"] = reserved / MiB


def report(results: list[dict]) -> None:
    success = [r for r in results if r["status"] == "SUCCESSFUL"]
    oom = [r for r in results if r["status"] == "OOM_CRASH"]
    halves = {
        name: [r for r in success if zlib.crc32(r["filename"].encode()) % 2 == index]
        for index, name in enumerate(("calibration", "check"))
    }
    labels = (
        ("reserved_low_mib", "no cuDNN workspaces (band low)"),
        ("reserved_mib", "band top"),
        ("card_reserved_mib", "band top replayed on the 40 GiB card"),
    )
    fixed_parts: dict[str, float] = {}
    for key, label in labels:
        smallest = sorted(halves["calibration"], key=lambda r: r["measured_mib"])
        smallest = smallest[: max(3, len(smallest) // 4)]
        if key == "card_reserved_mib":  # with the band top's fixed part: its smallest runs are far from full
            on_the_card(results, fixed_parts["reserved_mib"])
        fixed = fixed_parts[key] = statistics.median(r["measured_mib"] - r[key] for r in smallest)
        print(f"\n{label}: fixed part fitted on the calibration half = {fixed:,.0f} MiB")
        print("| half | runs | median error | median abs | 10th pct | 90th pct | worst low | worst high | under |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, rows in halves.items():
            rows = [r for r in rows if r[key] is not None]  # a completed run predicted to run out: below
            errors = sorted((r[key] + fixed - r["measured_mib"]) / r["measured_mib"] for r in rows)
            n = len(errors)
            print(
                f"| {name} | {n} | {statistics.median(errors):+.1%} | {statistics.median(map(abs, errors)):.1%} "
                f"| {errors[n // 10]:+.1%} | {errors[9 * n // 10]:+.1%} | {errors[0]:+.1%} | {errors[-1]:+.1%} "
                f"| {sum(e < 0 for e in errors)} |"
            )
        over = sum(r[key] is None or r[key] + fixed > A100_40GB_MIB for r in oom)
        false_alarm = sum(r[key] is None or r[key] + fixed > A100_40GB_MIB for r in success)
        print(
            f"out-of-memory runs predicted over 40 GiB: {over}/{len(oom)}; successful runs predicted over: "
            f"{false_alarm}/{len(success)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--rebuild", required=True)
    parser.add_argument("--successes", type=int, default=200)
    parser.add_argument("--ooms", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", help="write every prediction here (CSV)")
    args = parser.parse_args()
    results = predict(args)
    if args.out:
        with open(args.out, "x", newline="") as handle:  # never overwrite
            report(results)
            writer = csv.DictWriter(handle, COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(results)
    else:
        report(results)


if __name__ == "__main__":
    main()
