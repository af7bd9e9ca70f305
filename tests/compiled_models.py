"""Models a factory returns torch.compile'd, whole or in part (tests/test_compiled_models.py)."""

import torch
from torch import nn

FEATURES, HIDDEN = 32, 64


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def mlp() -> nn.Module:
    return Mlp()


def compiled_mlp() -> nn.Module:
    return torch.compile(Mlp())


def mlp_with_a_compiled_layer() -> nn.Module:
    model = Mlp()
    model.up = torch.compile(model.up)
    return model


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, FEATURES)
