"""Print a whole CPU training step of a small depthwise-and-pointwise conv net (ConvNeXt's pattern) measured by the
CPU allocator's events with oneDNN on (torch's default) and off, beside memplan's cpu prediction: what oneDNN's
convolutions hold inside themselves (their inputs, outputs and weights reordered to its blocked layouts, its
scratchpad), which memplan's cpu target does not model and says so in a note (memplan.estimator.notes).

Usage (from the repository root): python benchmarks/cpu_onednn_convolutions.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import memplan  # noqa: E402
from tests.hand_measure import profiled_third_iteration_peak  # noqa: E402

MODEL = "benchmarks.cpu_onednn_convolutions:model"
INPUTS = "benchmarks.cpu_onednn_convolutions:inputs"


class DepthwisePointwise(nn.Module):
    """A 7x7 depthwise convolution, a group norm and a pointwise MLP of 1x1 convolutions, then a linear head; the
    module computes its own cross entropy from the labels it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 7, padding=3, groups=8),
            nn.GroupNorm(1, 8),
            nn.Conv2d(8, 32, 1),
            nn.GELU(),
            nn.Conv2d(32, 8, 1),
            nn.Flatten(),
            nn.Linear(8 * 32 * 32, 10),
        )

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(images), labels)


def model() -> nn.Module:
    return DepthwisePointwise()


def inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 8, 32, 32), torch.randint(0, 10, (batch_size,))


def measured_step(onednn: bool, batch_size: int) -> int:
    """The third SGD step's peak by the CPU allocator's events (tests/hand_measure.py), oneDNN as given."""

    def build() -> Callable[[], None]:
        net = model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        batch = inputs(batch_size)

        def iteration() -> None:
            net(*batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return iteration

    return profiled_third_iteration_peak(build, onednn)


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for batch_size in (4, 16):
        for onednn in (True, False):
            with torch.backends.mkldnn.flags(enabled=onednn):  # memplan picks the convolutions' backends as the run
                predicted = memplan.estimate(MODEL, inputs=INPUTS, batch_size=batch_size, optimizer="sgd", device="cpu")
            measured = measured_step(onednn, batch_size)
            error = (predicted.peak_bytes - measured) / measured
            print(
                f"batch {batch_size}, oneDNN {'on ' if onednn else 'off'}: measured {measured:,} B, "
                f"memplan {predicted.peak_bytes:,} B ({error:+.1%})"
            )


if __name__ == "__main__":
    main()
