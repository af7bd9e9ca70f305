"""A two-layer MLP small enough to count by hand, for tests/test_distributed_by_hand.py: no biases,
no repeated blocks (FSDP2 shards the root alone), an output width of 30 rows that 4 and 8 ranks do
not divide (FSDP2 pads rank 0's shard)."""

import torch
from torch import nn

from tests.fsdp_models import mean_square  # the loss, as --loss tests.two_layer_mlp:mean_square names it

IN, HIDDEN, OUT = 64, 256, 30


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def two_layer() -> nn.Module:
    return TwoLayer()


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, IN)


__all__ = ["IN", "HIDDEN", "OUT", "TwoLayer", "two_layer", "rows", "mean_square"]
