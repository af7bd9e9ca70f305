"""memplan.validate.zoo: the suite's own models are the architectures they are named after."""

from __future__ import annotations

import torch

from memplan.validate.zoo import VGG16_CLASSES, vgg16, vgg16_inputs


def test_vgg16_is_torchvision_s_vgg16() -> None:
    model = vgg16()
    # torchvision's VGG16_Weights.IMAGENET1K_V1 metadata: "num_params": 138357544
    assert sum(parameter.numel() for parameter in model.parameters()) == 138_357_544
    convolutions = [module for module in model.features if isinstance(module, torch.nn.Conv2d)]
    assert [conv.out_channels for conv in convolutions] == [64, 64, 128, 128, 256, 256, 256] + [512] * 6
    assert sum(isinstance(module, torch.nn.MaxPool2d) for module in model.features) == 5


def test_vgg16_s_inputs_give_a_loss_that_trains_every_parameter() -> None:
    images, labels = vgg16_inputs(2)
    assert images.shape == (2, 3, 224, 224) and labels.shape == (2,)
    assert int(labels.max()) < VGG16_CLASSES
    model = vgg16()
    loss = model(images[:, :, :32, :32], labels)  # the adaptive pool takes any size; 32 px keeps it quick
    loss.backward()
    assert loss.dim() == 0
    assert all(parameter.grad is not None for parameter in model.parameters())
