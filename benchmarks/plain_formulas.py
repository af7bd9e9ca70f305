"""memplan's CPU prediction beside a plain run's allocator peak, for losses whose backward formulas have a
tensor-subclass branch (memplan.estimator.plain_formulas) or whose kernels hold inner temporaries
(memplan.estimator.composite_kernels).

Usage (from the repository root):  python benchmarks/plain_formulas.py
Run it in a checkout of an earlier commit (git worktree add /tmp/before COMMIT; PYTHONPATH=/tmp/before) for the
figures before a change. The model: Linear(64, 4000) on [64, 16, 64] inputs, SGD; truth: the CPU allocator's own
events of an unwatched run (tests/hand_measure.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.trace import trace_step  # noqa: E402
from memplan.settings import TrainingSettings  # noqa: E402
from tests.hand_measure import profiled_third_iteration_peak, training_iteration  # noqa: E402
from tests.module_specs import loss_returning_spec  # noqa: E402

BATCH, POSITIONS, FEATURES, WIDTH = 64, 16, 64, 4000
LOSSES = {
    "gather": lambda y: torch.gather(y, 2, torch.zeros(y.shape[0], POSITIONS, 1, dtype=torch.long)).mean(),
    "topk": lambda y: y.topk(10, dim=-1).values.mean(),
    "max(dim)": lambda y: y.max(dim=-1).values.mean(),
    "x[idx]": lambda y: y[:, :, torch.arange(0, WIDTH, 7)].mean(),
    "index_select": lambda y: torch.index_select(y, 2, torch.arange(0, WIDTH, 7)).mean(),
    "cummax": lambda y: y.cummax(dim=-1).values.mean(),
    "bce-with-logits": lambda y: F.binary_cross_entropy_with_logits(y, torch.ones_like(y)),
    "max() (whole)": lambda y: y.max(),
}


class _Wide(torch.nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        self.linear, self.loss = torch.nn.Linear(FEATURES, WIDTH), loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LOSSES[self.loss](self.linear(x))


def main() -> None:
    print("| loss | predicted (B) | plain run (B) | error |")
    print("| --- | ---: | ---: | ---: |")
    for loss in LOSSES:
        spec = loss_returning_spec(loss, lambda loss=loss: _Wide(loss), (POSITIONS, FEATURES))
        predicted = simulate(trace_step(spec, TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")))

        def build(loss: str = loss):
            torch.manual_seed(0)
            model = _Wide(loss)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            return training_iteration(model, torch.randn(BATCH, POSITIONS, FEATURES), lambda out, _: out, optimizer)

        measured = profiled_third_iteration_peak(build)
        error = (predicted.peak_bytes - measured) / measured
        print(f"| {loss} | {predicted.peak_bytes:,} | {measured:,} | {error:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
