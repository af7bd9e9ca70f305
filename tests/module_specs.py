"""A ModelSpec for a small nn.Module that returns its own loss: what the CUDA rule tests trace."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from memplan.models.source import ModelRef, ModelSpec


def loss_returning_spec(name: str, build: Callable[[], nn.Module], sample_shape: tuple[int, ...]) -> ModelSpec:
    """`build()`'s module takes a float32 batch of `sample_shape` per sample and returns the loss."""
    return ModelSpec(
        ModelRef(name),
        lambda settings: build(),
        lambda settings, dtype: torch.randn(settings.batch_size, *sample_shape),
        lambda output, batch: output,
        lambda settings: settings,
    )
