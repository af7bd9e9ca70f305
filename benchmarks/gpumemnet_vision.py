"""memplan's cuda prediction beside torchvision conv nets trained on a real A100-SXM4-40GB.

The data (not shipped with memplan): itu-rad/GPUMemNet's "real-world unseen models" table
(Test_Pipeline/GPUMemNet_CNN.xlsx, also Results_plotter_for_paper/data.csv): torchvision's vgg16,
resnet50, mobilenet_v2, efficientnet_b0 and inception_v3 (aux_logits=False, 299 px; the others 224
px), trained from scratch on ImageNet at batch 32, 64 and 128 by Test_Pipeline/cnn_models/*.py:
fp32, nn.CrossEntropyLoss, torch.optim.Adam(lr=1e-3), no cuDNN flags (benchmark off). The figure
is the GPU memory the run used, in MiB (the lab's tooling reads nvidia-smi); torch 2.x, version
not recorded, on the same machine as benchmarks/gpumemnet_conv.py's runs. timm's xception, the
table's sixth model, is left out (memplan's environment has no timm).

None of these runs was used to make memplan's rules: they are a check. The one constant is the
device's fixed part (nvidia-smi minus reserved: CUDA context, cuDNN handles and kernels on that
machine), which is not fitted here: pass the one gpumemnet_conv.py fits on its calibration half
for the band top (`--fixed-mib`, 1,709 MiB as of 2026-11-25).

Each prediction is memplan's reserved peak (the band top) replayed on the card itself: 40 GiB less
the fixed part for torch (memplan.estimator.timeline.reserved_peak_bytes with capacity_bytes), plus
the fixed part. Needs torchvision (memplan does not depend on it).

usage: python benchmarks/gpumemnet_vision.py --data gpumemnet_vision_models_measured.csv --fixed-mib 1709
       (CSV columns: model, batch_size, measured_gpu_mem_mib; model one of vgg, resnet, mobilenet,
       efficientnet, inception, Xception)
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
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
NUM_CLASSES = 1000  # ImageNet, torchvision's default head


def _models() -> dict[str, tuple[object, int]]:
    """The table's model names: (torchvision constructor as the scripts call it, image size)."""
    try:
        from torchvision import models
    except ImportError as error:
        raise SystemExit(f"this benchmark needs torchvision ({error}): pip install torchvision") from error
    return {
        "vgg": (lambda: models.vgg16(weights=None), 224),
        "resnet": (lambda: models.resnet50(weights=None), 224),
        "mobilenet": (lambda: models.mobilenet_v2(weights=None), 224),
        "efficientnet": (lambda: models.efficientnet_b0(weights=None), 224),
        "inception": (lambda: models.inception_v3(weights=None, aux_logits=False, init_weights=False), 299),
    }


def _spec(name: str, build: object, image: int) -> ModelSpec:
    loss = nn.CrossEntropyLoss()
    return ModelSpec(
        ModelRef(name),
        lambda settings: build(),  # type: ignore[operator]
        lambda settings, dtype: (torch.randn(settings.batch_size, 3, image, image, dtype=dtype),),
        lambda output, batch: loss(output, torch.zeros(batch[0].shape[0], dtype=torch.long)),
        lambda settings: settings,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--fixed-mib", type=float, required=True, help="the device's fixed part (docstring)")
    args = parser.parse_args()
    models = _models()
    capacity = int((A100_40GB_MIB - args.fixed_mib) * MiB)
    errors = []
    print("| model | batch | measured MiB | predicted MiB | error | band low MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in csv.DictReader(open(args.data)):
        name = row["model"]
        if name not in models:
            print(f"| {name} | {row['batch_size']} | {row['measured_gpu_mem_mib']} | (not traced) | | |")
            continue
        build, image = models[name]
        settings = TrainingSettings(batch_size=int(row["batch_size"]), optimizer="adam", gpu="A100-40GB")
        simulation = simulate(trace_step(_spec(name, build, image), settings))
        measured = float(row["measured_gpu_mem_mib"])
        try:
            card = reserved_peak_bytes(simulation.timeline, simulation.allocator_config, capacity) / MiB
        except OutOfMemory:
            print(f"| {name} | {row['batch_size']} | {measured:,.0f} | out of memory | | |")
            continue
        low = (simulation.conv_workspace_free_reserved_peak_bytes or 0) / MiB + args.fixed_mib
        error = (card + args.fixed_mib - measured) / measured
        errors.append(error)
        print(
            f"| {name} | {row['batch_size']} | {measured:,.0f} | {card + args.fixed_mib:,.0f} | {error:+.1%} "
            f"| {low:,.0f} |",
            flush=True,
        )
    print(
        f"\n{len(errors)} runs: median error {statistics.median(errors):+.1%}, median |error| "
        f"{statistics.median(map(abs, errors)):.1%}, worst {min(errors):+.1%} / {max(errors):+.1%}, "
        f"{sum(e < 0 for e in errors)} low"
    )


if __name__ == "__main__":
    main()
