"""The canonical training loop, run identically under fake tensors (to trace) and real ones (to measure).

for micro_batch in range(grad_accum):
    with autocast(...):                      # amp-* precisions only
        loss = loss_of(model(**batch))       # model output not kept past the loss
    (loss / grad_accum).backward()           # scaled by the loss scale for amp-fp16
optimizer.step()                             # after unscaling the gradients for amp-fp16
optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from memplan.estimator.checkpointing import apply_checkpointing
from memplan.estimator.optimizers import build_optimizer, optimizer_state_tensors
from memplan.models.source import Batch, ModelSpec, call_model
from memplan.settings import TrainingSettings

STORAGE_DTYPES = {
    "fp32": torch.float32,
    "amp-bf16": torch.float32,
    "amp-fp16": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
AUTOCAST_DTYPES = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}
# torch.amp.GradScaler's default init_scale (torch/amp/grad_scaler.py).
INITIAL_LOSS_SCALE = 2.0**16

Marker = Callable[[str], None]


def _no_marker(phase: str) -> None:
    return None


@dataclass
class TrainingState:
    """Live objects of one training setup: the model, its batch, optimizer and loss-scaler state."""

    model: nn.Module
    batch: Batch
    optimizer: Optimizer | None
    loss_of: Callable[[Any, Batch], torch.Tensor]
    settings: TrainingSettings
    trainable: list[nn.Parameter]
    checkpointed_blocks: list[str]
    loss_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    autocast_device: str = "cpu"  # where the tensors are: fake CPU when tracing, cuda in a real CUDA run


def cast_floating_point(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for floating-point parameters and buffers, also under fake tensors.

    `nn.Module.to` swaps parameter storage in place, which fake tensors refuse; replacing each
    parameter (once, so tied weights stay tied) gives the same memory.
    """
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point():
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)


def prepare(spec: ModelSpec, settings: TrainingSettings) -> TrainingState:
    """Build model, batch and optimizer in the active tensor mode (fake or real)."""
    model = spec.build(settings)
    model.train()
    dtype = STORAGE_DTYPES[settings.precision]
    if dtype != torch.float32:
        cast_floating_point(model, dtype)
    checkpointed = apply_checkpointing(model, settings.checkpoint)
    batch = spec.make_batch(settings, dtype)
    trainable = [param for param in model.parameters() if param.requires_grad]
    state = TrainingState(
        model=model,
        batch=batch,
        optimizer=build_optimizer(trainable, settings),
        loss_of=spec.loss_of,
        settings=settings,
        trainable=trainable,
        checkpointed_blocks=checkpointed,
    )
    if settings.precision == "amp-fp16":
        # GradScaler keeps its scale and found-inf flag as one-element float32 tensors.
        state.loss_scale = torch.full((1,), INITIAL_LOSS_SCALE, dtype=torch.float32)
        state.found_inf = torch.zeros((1,), dtype=torch.float32)
    return state


def autocast_context(settings: TrainingSettings, device_type: str = "cpu"):
    if not settings.is_amp:
        return nullcontext()
    # The tracer runs on fake CPU tensors for both targets (design.md §3); a cuda target's trace
    # applies CUDA's op lists through memplan.estimator.cuda.autocast.
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[settings.precision])


def micro_batch(state: TrainingState, marker: Marker = _no_marker) -> None:
    settings = state.settings
    with autocast_context(settings, state.autocast_device):
        loss = state.loss_of(call_model(state.model, state.batch), state.batch)
    marker("forward")
    if settings.grad_accum > 1:
        loss = loss / settings.grad_accum
    if state.loss_scale is not None:
        loss = loss * state.loss_scale
    loss.backward()
    marker("backward")


def model_tensors(state: TrainingState) -> list[torch.Tensor]:
    return [*state.model.parameters(), *state.model.buffers()]


def optimizer_tensors(state: TrainingState) -> list[torch.Tensor]:
    """The optimizer's state, and GradScaler's scale and found-inf flag (amp-fp16)."""
    scaler = [tensor for tensor in (state.loss_scale, state.found_inf) if tensor is not None]
    return optimizer_state_tensors(state.optimizer) + scaler


def current_grads(state: TrainingState) -> list[torch.Tensor]:
    return [param.grad for param in state.trainable if param.grad is not None]


def drop_grads(state: TrainingState) -> None:
    """zero_grad(set_to_none=True) on every trainable parameter."""
    for param in state.trainable:
        param.grad = None


def optimizer_step(state: TrainingState) -> list[torch.Tensor]:
    """Unscale (amp-fp16), step, zero_grad(set_to_none=True); returns the gradients it dropped."""
    grads = current_grads(state)
    if state.loss_scale is not None and grads:
        inv_scale = state.loss_scale.double().reciprocal().float()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, state.found_inf, inv_scale)
    if state.optimizer is not None:
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    drop_grads(state)
    return grads


def iteration(state: TrainingState, marker: Marker = _no_marker) -> None:
    """One whole iteration of the canonical loop (used by real runs)."""
    for _ in range(state.settings.grad_accum):
        micro_batch(state, marker)
    optimizer_step(state)
