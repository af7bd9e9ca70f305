"""One training step run for real on the CPU and measured, written in plain PyTorch (no memplan loop code)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memplan.measure.collector import collector_held
from memplan.measure.cpu import LiveStorageCounter


def measured_step_peak(
    step: Callable[[torch.nn.Module, dict, torch.optim.Optimizer], None],
    model: torch.nn.Module,
    batch: dict,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Peak live tensor-storage bytes of the second call of step(model, batch, optimizer): the first
    creates the optimizer state; whatever it leaves (gradients included) is live as the second starts."""
    step(model, batch, optimizer)
    counter = LiveStorageCounter()
    for tensor in [*model.parameters(), *model.buffers(), *batch.values()]:
        counter.add_static(tensor)
    for state in optimizer.state.values():
        for value in state.values():
            counter.add_static(value)
    for param in model.parameters():
        if param.grad is not None:
            counter.add_live(param.grad)  # the previous step's gradients, where the step kept them
    with collector_held(), counter:
        step(model, batch, optimizer)
    return counter.peak_bytes
