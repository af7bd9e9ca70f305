"""Models of the extended validation suite that no preset covers, named by import path.

`unet` is a U-Net-like segmentation net (Ronneberger et al. 2015, with BatchNorm and padding, as
most PyTorch re-implementations write it): the conv workload whose cuDNN workspaces and large
feature maps the presets' ResNets do not reach. Used as
`memplan estimate memplan.validate.zoo:unet --inputs memplan.validate.zoo:unet_inputs`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

UNET_IMAGE_SIZE = 256
UNET_CLASSES = 2
UNET_WIDTHS = (64, 128, 256, 512)


class _DoubleConv(nn.Sequential):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, classes: int = UNET_CLASSES, widths: tuple[int, ...] = UNET_WIDTHS):
        super().__init__()
        self.down = nn.ModuleList()
        channels = in_channels
        for width in widths:
            self.down.append(_DoubleConv(channels, width))
            channels = width
        self.bottom = _DoubleConv(channels, channels * 2)
        self.upsample = nn.ModuleList()
        self.up = nn.ModuleList()
        channels *= 2
        for width in reversed(widths):
            self.upsample.append(nn.ConvTranspose2d(channels, width, 2, stride=2))
            self.up.append(_DoubleConv(width * 2, width))
            channels = width
        self.head = nn.Conv2d(channels, classes, 1)

    def forward(self, images: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        skips = []
        x = images
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = functional.max_pool2d(x, 2)
        x = self.bottom(x)
        for upsample, block, skip in zip(self.upsample, self.up, reversed(skips), strict=True):
            x = block(torch.cat([upsample(x), skip], dim=1))
        return functional.cross_entropy(self.head(x), masks)


def unet() -> UNet:
    return UNet()


def unet_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and their per-pixel class masks; the model returns the loss."""
    images = torch.randn(batch_size, 3, UNET_IMAGE_SIZE, UNET_IMAGE_SIZE)
    masks = torch.randint(0, UNET_CLASSES, (batch_size, UNET_IMAGE_SIZE, UNET_IMAGE_SIZE))
    return images, masks
