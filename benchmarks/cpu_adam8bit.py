"""memplan's cpu-target prediction with `--optimizer adam8bit` beside a plain run with bitsandbytes' own Adam8bit: the
README's known miss (memplan models the fused CUDA kernel, which allocates nothing; bitsandbytes' CPU kernel,
backends/cpu/ops.py, makes float32 copies of both moments, the gradient and a square root per parameter).

Usage (from the repository root):  python benchmarks/cpu_adam8bit.py   (needs bitsandbytes)
Truth: the CPU allocator's own events of an unwatched run (tests/hand_measure.py), model and batch made under them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bitsandbytes as bnb  # noqa: E402
import torch  # noqa: E402

from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.trace import trace_step  # noqa: E402
from memplan.settings import TrainingSettings  # noqa: E402
from tests.hand_measure import profiled_third_iteration_peak, training_iteration  # noqa: E402
from tests.module_specs import loss_returning_spec  # noqa: E402

BATCH, FEATURES = 32, 64


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).pow(2).mean()


class _Embedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Linear(FEATURES, 5000, bias=False)  # a 5000 x 64 table, read densely

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x).pow(2).mean()


MODELS = {"mlp": _Mlp, "5000x64 table": _Embedding}


def main() -> None:
    print("| model | predicted (B) | plain run with bnb.optim.Adam8bit (B) | error |")
    print("| --- | ---: | ---: | ---: |")
    for name, make in MODELS.items():
        spec = loss_returning_spec(name, make, (FEATURES,))
        settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="adam8bit")
        predicted = simulate(trace_step(spec, settings)).peak_bytes

        def build(make=make):  # type: ignore[no-untyped-def]
            torch.manual_seed(0)
            model = make()
            optimizer = bnb.optim.Adam8bit(model.parameters())
            return training_iteration(model, torch.randn(BATCH, FEATURES), lambda out, _: out, optimizer)

        measured = profiled_third_iteration_peak(build)
        print(f"| {name} | {predicted:,} | {measured:,} | {(predicted - measured) / measured:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
