"""Models of the extended validation suite that no preset covers, named by import path.

`unet` is a U-Net-like segmentation net (Ronneberger et al. 2015, with BatchNorm and padding, as
most PyTorch re-implementations write it): the conv workload whose cuDNN workspaces and large
feature maps the presets' ResNets do not reach. Used as
`memplan estimate memplan.validate.zoo:unet --inputs memplan.validate.zoo:unet_inputs`.

`vgg16` is torchvision's `vgg16()` (configuration "D" of Simonyan and Zisserman 2014, as
torchvision/models/vgg.py builds it: thirteen 3x3 convolutions with biases and in-place ReLUs, five
max-pools, an adaptive average pool to 7x7, a classifier of three Linear layers with dropout; 138,357,544
parameters), written out so that no torchvision is needed. Its first convolutions run on 224x224 maps of
64 channels, where memplan predicts 18-25% less memory than GPUMemNet's A100 runs of torchvision's vgg16
used at batches 64 and 128 (docs/validation.md, "cuDNN convolution workspaces"): which plans cuDNN picks there is what a
GPU run of it shows. `memplan estimate memplan.validate.zoo:vgg16 --inputs memplan.validate.zoo:vgg16_inputs`.
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


VGG16_CONVOLUTIONS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
VGG16_IMAGE_SIZE = 224
VGG16_CLASSES = 1000


class VGG16(nn.Module):
    def __init__(self, classes: int = VGG16_CLASSES) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in VGG16_CONVOLUTIONS:
            if width == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, int(width), kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                channels = int(width)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=0.5),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=0.5),
            nn.Linear(4096, classes),
        )

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.avgpool(self.features(images)), 1)
        return functional.cross_entropy(self.classifier(x), labels)


def vgg16() -> VGG16:
    return VGG16()


def vgg16_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ImageNet-sized images and their class labels; the model returns the loss."""
    images = torch.randn(batch_size, 3, VGG16_IMAGE_SIZE, VGG16_IMAGE_SIZE)
    labels = torch.randint(0, VGG16_CLASSES, (batch_size,))
    return images, labels
