"""Models whose forward modifies tensors in place, for tests/test_partial_training.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 64


class Residual(nn.Module):
    """In-place ops in the forward, as ResNet-style code writes them: legal where no op saved what they change."""

    def __init__(self, blocks: int = 3, relu_then_scale: bool = False) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))
        self.relu_then_scale = relu_then_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            residual = x
            x = linear(x)  # addmm saves its input, not its output: the in-place ops below may change it
            x = F.dropout(x, 0.1, training=self.training, inplace=True)
            x += residual
            x = F.relu(x, inplace=True)  # saves its result
            if self.relu_then_scale:
                x.mul_(0.5)  # changes the result relu saved: the backward fails
        return x.square().mean()


def residual_in_place() -> nn.Module:
    return Residual()


def residual_scaled_after_relu() -> nn.Module:
    return Residual(relu_then_scale=True)


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH)


class FrozenNormBackbone(nn.Module):
    """A frozen backbone whose batch norms and dropout stay in eval mode through `model.train()`: the `norm_eval`
    pattern of mmdetection's and timm's backbones, which override `train()` so that a script's `model.train()`
    cannot put them back in training mode. A trainable stem below it: its gradient flows through the frozen layers,
    which save their activations for it (dropout's mask only in training mode)."""

    def __init__(self, norm_eval: bool = True) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Dropout(0.1), nn.Linear(WIDTH, WIDTH)
        )
        self.backbone.requires_grad_(False)
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.norm_eval = norm_eval

    def train(self, mode: bool = True) -> FrozenNormBackbone:
        super().train(mode)
        if mode and self.norm_eval:
            self.backbone.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(self.stem(x)).square().mean()


def frozen_norm_backbone() -> nn.Module:
    return FrozenNormBackbone()


def frozen_backbone_trained_norms() -> nn.Module:
    return FrozenNormBackbone(norm_eval=False)
