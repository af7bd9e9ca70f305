"""torchvision's models as the sources' scripts train them, for the rows of published.json that trace them.

The rasbt-vit-* rows:

rasbt/pytorch-memory-optim (01_pytorch-vit.py .. 06_sgd-with-scheduler.py) and rasbt/cvpr2023
(01_pytorch-vit.py, 04_fabric-vit-mixed-precision.py) fine-tune `torchvision.models.vit_l_16` /
`vit_b_16` on CIFAR-10 resized to 224x224:

    model = vit_l_16(weights=ViT_L_16_Weights.IMAGENET1K_V1)
    model.heads.head = torch.nn.Linear(in_features=1024, out_features=10)   # 768 for vit_b_16
    ...
    logits = model(features)
    loss = F.cross_entropy(logits, targets)

The pretrained weights change no shape, so the factories build the models without them (nothing is
downloaded).

The gpumemnet-* rows: itu-rad/GPUMemNet's Test_Pipeline/cnn_models/{vgg,resnet50,mobilenet,
efficientNet,inception}.py train torchvision's models from scratch on ImageNet (1,000 classes) with
nn.CrossEntropyLoss: `models.vgg16(pretrained=False)`, `models.resnet50(pretrained=False)`,
`models.mobilenet_v2(weights=None)`, `models.efficientnet_b0(...)`, `models.inception_v3(
aux_logits=False)` on 299x299 crops (the others 224x224).

Needs torchvision, which only these benchmarks use (memplan does not depend on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    from torchvision import models
    from torchvision.models import vit_b_16, vit_l_16
except ImportError as error:  # published.py checks first and says so in one line
    raise ImportError("these rows need torchvision: pip install torchvision") from error

IMAGE_SIZE = 224
NUM_CLASSES = 10


class FabricStyle(nn.Module):
    """What Lightning Fabric's `_FabricModule` does around the forward of the scripts that use it
    (lightning/fabric/wrappers.py with the precision plugins of plugins/precision/{half,amp}.py):
    the floating-point input cast to the precision's dtype (`convert_input`: bfloat16 for
    "bf16-true" and "bf16-mixed", float16 for "16-mixed"), the output cast back to float32
    (`convert_output`). The float32 batch the data loader delivered stays alive beside the cast
    copy. For float32 runs (the plain-PyTorch scripts) both casts are no-ops.

    memplan gives "bf16-true" as --precision bf16 (the parameters cast) and "*-mixed" as
    --precision amp-* (autocast); the dtype is read from those: the parameters' dtype, else
    autocast's where it is on."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        dtype = next(self.module.parameters()).dtype
        device = images.device.type
        if dtype == torch.float32 and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        return self.module(images.to(dtype)).float()


def _with_cifar10_head(model: nn.Module, width: int) -> nn.Module:
    model.heads.head = nn.Linear(in_features=width, out_features=NUM_CLASSES)  # "replace output layer"
    return FabricStyle(model)


def rasbt_vit_l_16() -> nn.Module:
    """torchvision's vit_l_16 (24 layers, width 1024, 16 heads, MLP 4096) with a 10-class head."""
    return _with_cifar10_head(vit_l_16(), 1024)


def rasbt_vit_b_16() -> nn.Module:
    """torchvision's vit_b_16 (12 layers, width 768, 12 heads, MLP 3072) with a 10-class head."""
    return _with_cifar10_head(vit_b_16(), 768)


def cifar10_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the scripts' loaders give it: float32 images (ToTensor after Resize((224, 224)))
    and int64 class labels."""
    images = torch.rand(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,))
    return images, labels


def cross_entropy(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`F.cross_entropy(logits, targets)`, as every script computes its loss."""
    return F.cross_entropy(logits, batch[1])


IMAGENET_CLASSES = 1000


class ImagesOnly(nn.Module):
    """`outputs = model(images)`: the batch memplan passes is (images, labels), the loss takes the labels."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.module(images)


def gpumemnet_vgg16() -> nn.Module:
    return ImagesOnly(models.vgg16(weights=None))


def gpumemnet_resnet50() -> nn.Module:
    return ImagesOnly(models.resnet50(weights=None))


def gpumemnet_mobilenet_v2() -> nn.Module:
    return ImagesOnly(models.mobilenet_v2(weights=None))


def gpumemnet_efficientnet_b0() -> nn.Module:
    return ImagesOnly(models.efficientnet_b0(weights=None))


def gpumemnet_inception_v3() -> nn.Module:
    """aux_logits=False as the script builds it; init_weights=False only skips torchvision's scipy-based
    initialisation, which changes no shape."""
    return ImagesOnly(models.inception_v3(weights=None, aux_logits=False, init_weights=False))


def _imagenet_batch(batch_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.rand(batch_size, 3, size, size)
    labels = torch.randint(0, IMAGENET_CLASSES, (batch_size,))
    return images, labels


def imagenet_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 224x224 crops (Resize(256) + CenterCrop(224)) with int64 labels."""
    return _imagenet_batch(batch_size, 224)


def imagenet_batch_299(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inception's 299x299 crops."""
    return _imagenet_batch(batch_size, 299)
