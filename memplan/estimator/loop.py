"""The training loop, run identically under fake tensors (to trace) and real ones (to measure).

The canonical loop (`--loop canonical`):

for micro_batch in range(grad_accum):
    with autocast(...):                      # amp-* precisions only
        loss = loss_of(model(**batch))       # model output not kept past the loss
    (loss / grad_accum).backward()           # scaled by the loss scale for amp-fp16
optimizer.step()                             # after unscaling the gradients for amp-fp16
optimizer.zero_grad(set_to_none=True)

The variants people write (settings.LOOPS), each differing only where noted:
- zero-grad-before-backward: `optimizer.zero_grad()` (set_to_none=True) after the forward and
  before `backward()`, none after the step, as in PyTorch's own tutorials: the previous step's
  gradients live through the next forward.
- set-to-none-false: `optimizer.zero_grad(set_to_none=False)` after the step (torch < 2.0's default,
  HF Trainer before it, many scripts): gradients are zeroed in place and never freed.
- hf-trainer: transformers' Trainer (5.x, `_inner_training_loop`): the gradients clipped to norm 1.0
  (`max_grad_norm`'s default) with torch.nn.utils.clip_grad_norm_ before the step, then
  `model.zero_grad()` (set_to_none=True). It fetches a step's `grad_accum` micro-batches before the
  first forward (`get_batch_samples`), each moved to the device as accelerate hands it out, and its
  list holds them all until the step is over: `grad_accum - 1` batches more than the other loops hold.
- keep-output: `out = model(...)`, `loss_of(out).backward()`, `del out` after the step: the model output
  (logits, and a Hugging Face model's key/value cache where its config has `use_cache` on) stays alive
  through the backward and the optimizer step.

What the loop keeps bound matters beyond the tensors' bytes: `loss` (the canonical loop and the first two
variants bind it) holds the loss's autograd graph until the next micro-batch's forward rebinds it or the
iteration ends. The backward frees the graph's saved tensors, not its Nodes, and with them lives what custom
autograd Functions keep as context attributes: torch's reentrant checkpoint's copy of the RNG state (5,056 B a
region on the CPU) and its function's arguments, bitsandbytes' 8-bit matmuls' layer inputs (`ctx.A`), a leaf
the forward made (enable_input_require_grads): all alive through the optimizer step (TrainingState.kept_loss).
hf-trainer's training_step returns `loss.detach()`: the loss's storage lives through the step, its graph not.
keep-output's `loss_of(out)` is bound to nothing (a Hugging Face output's own loss is kept with `out`).

A custom step (`--step package.module:fn`, settings.step; memplan.estimator.user_step) replaces the loop: memplan calls
`fn(model, batch, optimizer)` once per iteration, with the model, batch and optimizer built as for
the loop (storage precision, LoRA and checkpointing applied; `optimizer` None with `--optimizer
none`). Whatever fn does is what runs: its forward passes, losses, backward calls, optimizer step
and zero_grad. The phases are where it calls them: the forward ends at its first backward, the
backward at its first optimizer.step().
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from memplan.distributed.modes import DDP_MODES, FSDP_MODES, RESHARDING_FSDP_MODES
from memplan.errors import SettingsError
from memplan.estimator.checkpointing import apply_checkpointing
from memplan.estimator.fake_conversions import cast_floating_point
from memplan.estimator.leaves import refuse_sparse_tensors, tensors_in
from memplan.estimator.optimizers import build_optimizer, optimizer_state_tensors
from memplan.estimator.trainer_loss import (
    float32_outputs,
    items_in_batch,
    label_smoothed_loss,
    smooths_labels,
    without_labels,
)
from memplan.finetune.lora import adapter_parameters, with_lora
from memplan.finetune.quantize import bookkeeping_buffers, quantized
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
FSDP_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --fsdp-mixed-precision
# torch.amp.GradScaler's default init_scale (torch/amp/grad_scaler.py).
INITIAL_LOSS_SCALE = 2.0**16

Marker = Callable[[str], None]


def no_marker(phase: str) -> None:
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
    micro_batches_done: int = 0  # zero-grad-before-backward zeroes only on the first of each step's
    # --parallel: the rank's DistributedDataParallel (its wrapper is `model`) and its buckets, or FSDP2's
    # sharded model.
    data_parallel: Any = None  # memplan.distributed.ddp.DataParallelRank or .fsdp.FullyShardedRank
    # The trainable parameters a micro-batch's backward reaches (ids), where a warm-up found them out: a loop
    # that keeps gradients across micro-batches holds gradients for these only (memplan.estimator.trace).
    reached: frozenset[int] | None = None
    # The step's other micro-batches, where the loop fetches them all before the first (hf-trainer): held to its end.
    fetched_batches: list[Batch] = field(default_factory=list)
    # The keep-output loop's `out`: the last micro-batch's model output, held through the step (`del out` after it).
    kept_output: Any = None
    # The loss the loop keeps bound (module docstring): its graph's Nodes, and what they hold, live until the next
    # micro-batch's forward rebinds it or the iteration ends, after zero_grad.
    kept_loss: torch.Tensor | None = None

    @property
    def built_model(self) -> nn.Module:
        """The model as built, adapted and checkpointed, inside any data-parallel wrapper: module names
        (for plans and reports) are its own."""
        return self.data_parallel.module if self.data_parallel is not None else self.model


def _refuse_sparse_gradients(model: nn.Module) -> None:
    """nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) make sparse COO gradients, whose memory is
    two tensors (indices and values) with no storage of their own: memplan keys every tensor by its storage,
    and had failed with torch's "Cannot access storage of SparseTensorImpl", blamed on the loss or optimizer."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse and module.weight.requires_grad:
            kind = type(module).__name__
            raise SettingsError(
                f"module {name or kind} makes sparse gradients ({kind}(sparse=True)), which memplan does not model: "
                "estimate with sparse=False, whose dense gradient is at least as large while a batch holds fewer "
                "distinct rows than the table"
            )


def prepare(spec: ModelSpec, settings: TrainingSettings) -> TrainingState:
    """Build model, batch and optimizer in the active tensor mode (fake or real)."""
    model = spec.build(settings)
    _refuse_sparse_gradients(model)
    refuse_sparse_tensors(model)
    model.train()
    dtype = STORAGE_DTYPES[settings.precision]
    if dtype != torch.float32:  # adapters the user's own peft model holds keep their dtype, as peft keeps them
        cast_floating_point(model, dtype, keep=adapter_parameters(model))
    model = quantized(model, settings)  # QLoRA: the base layers in 4 bits, before peft wraps them
    model = with_lora(model, settings)  # after the cast: peft keeps a 16-bit model's adapters in float32
    checkpointed = apply_checkpointing(model, settings.checkpoint)
    batch = spec.make_batch(settings, dtype)
    trainable = [param for param in model.parameters() if param.requires_grad]
    if not trainable and settings.step is None and settings.parallel == "none":
        # The backward would fail in autograd ("element 0 of tensors does not require grad"): a usage mistake.
        # (The data-parallel ranks say it themselves; a --step may train what it likes.)
        raise SettingsError(
            f"{spec.name} has no trainable parameter (none requires grad), so a training step has "
            "nothing to compute gradients for: unfreeze what it trains, or give --lora RANK to train adapters"
        )
    data_parallel = None
    # DDP wraps the model as built, adapted and checkpointed, as scripts do (not under DeepSpeed's stage 1).
    if settings.parallel in DDP_MODES and settings.deepspeed_stage is None:
        from memplan.distributed.ddp import DataParallelRank

        data_parallel = DataParallelRank(
            model,
            settings.world_size,
            not_broadcast=bookkeeping_buffers(model),
            gradient_as_bucket_view=settings.ddp_bucket_view,
        )
        model = data_parallel.wrapper
    elif settings.parallel in FSDP_MODES:  # each repeated block, then the root, as FSDP2 scripts shard
        from memplan.distributed.fsdp import FullyShardedRank

        data_parallel = FullyShardedRank(
            model,
            settings.world_size,
            reshard_after_forward=settings.parallel in RESHARDING_FSDP_MODES,
            shard_size=settings.shard_size,
            mixed_precision=FSDP_PARAM_DTYPES.get(settings.fsdp_mixed_precision or ""),
            offload=settings.offload == "params",
            pins_host_memory=settings.device == "cuda",
        )
        trainable = [param for param in model.parameters() if param.requires_grad]  # its sharded DTensors
    optimizer = build_optimizer(trainable, settings)
    if settings.deepspeed_stage is not None:  # DeepSpeed's engine wraps the model and the optimizer
        from memplan.distributed.deepspeed import DeepSpeedRank
        from memplan.distributed.deepspeed_config import deepspeed_config, runs_deepspeed_cpu_adam

        assert optimizer is not None  # settings refuse --optimizer none
        hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)  # transformers' "auto"
        stage = settings.deepspeed_stage
        user_config = settings.deepspeed_settings
        config = deepspeed_config(
            stage,
            settings.batch_size,
            settings.precision,
            user_config,
            hidden_size,
            settings.grad_accum,
            settings.offload,
        )
        data_parallel = DeepSpeedRank(
            model,
            optimizer,
            settings.world_size,
            config,
            pins_host_memory=settings.device == "cuda",
            cpu_adam=runs_deepspeed_cpu_adam(user_config),
        )
        model = data_parallel.wrapper
    state = TrainingState(
        model=model,
        batch=batch,
        optimizer=optimizer,
        loss_of=spec.loss_of,
        settings=settings,
        trainable=trainable,
        checkpointed_blocks=checkpointed,
        data_parallel=data_parallel,
        fetched_batches=fetched_ahead(spec, settings),
    )
    if settings.precision == "amp-fp16" and settings.deepspeed_stage is None:  # DeepSpeed scales its own
        # GradScaler keeps its scale and found-inf flag as one-element float32 tensors.
        state.loss_scale = torch.full((1,), INITIAL_LOSS_SCALE, dtype=torch.float32)
        state.found_inf = torch.zeros((1,), dtype=torch.float32)
    return state


def fetched_ahead(spec: ModelSpec, settings: TrainingSettings) -> list[Batch]:
    """The micro-batches of a step the loop holds beside the one it runs: with the hf-trainer loop, the step's
    other `grad_accum - 1` (transformers' Trainer, `get_batch_samples`: module docstring); none otherwise."""
    if settings.loop != "hf-trainer" or settings.step is not None:
        return []
    dtype = STORAGE_DTYPES[settings.precision]
    return [spec.make_batch(settings, dtype) for _ in range(settings.grad_accum - 1)]


def input_tensors(state: TrainingState) -> list[torch.Tensor]:
    """The tensors of the micro-batch the iteration runs and of those it holds beside it."""
    return [tensor for batch in (state.batch, *state.fetched_batches) for tensor in tensors_in(batch)]


def autocast_context(settings: TrainingSettings, device_type: str = "cpu"):
    if not settings.is_amp:
        return nullcontext()
    # The tracer runs on fake CPU tensors for both targets (design.md §3); a cuda target's trace
    # applies CUDA's op lists through memplan.estimator.cuda.autocast.
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[settings.precision])


# transformers' TrainingArguments.max_grad_norm default, clipped by Trainer before each step.
HF_TRAINER_MAX_GRAD_NORM = 1.0


# Loops that bind the loss to a variable (`loss = loss_of(...)`): its graph lives until the iteration ends.
LOOPS_BINDING_THE_LOSS = ("canonical", "zero-grad-before-backward", "set-to-none-false")


# Loops whose gradients are still allocated when the next iteration begins (the rest free them at
# zero_grad(set_to_none=True) after the step).
LOOPS_KEEPING_GRADIENTS = ("zero-grad-before-backward", "set-to-none-false")


def gradients_outlive_the_step(settings: TrainingSettings) -> bool:
    """Whether the traced micro-batch starts with gradients allocated: a later micro-batch of an
    accumulating step, or a loop that frees the previous step's gradients late or never."""
    return settings.grad_accum > 1 or settings.loop in LOOPS_KEEPING_GRADIENTS


def micro_batch(state: TrainingState, marker: Marker = no_marker) -> None:
    settings = state.settings
    engine = _engine(state)
    # DeepSpeed's engine opens its own autocast around the model (torch_autocast, autocast_if_enabled).
    autocast = autocast_context(settings, state.autocast_device) if engine is None else nullcontext()
    # The Trainer's label smoothing (memplan.estimator.trainer_loss): the model runs without the labels, and
    # transformers' LabelSmoother computes the loss after the (autocast) forward, from its float32 outputs.
    smoothing = settings.loop == "hf-trainer" and smooths_labels(
        state.built_model, state.batch, settings.label_smoothing
    )
    inputs, labels = without_labels(state.batch) if smoothing else (state.batch, None)
    counted = items_in_batch(state.built_model, labels) if labels is not None else None
    with autocast, engine.forward_context() if engine else nullcontext():
        output = call_model(state.model, inputs)
        if settings.loop == "keep-output":
            state.kept_output = output  # `out = model(...)`: the previous micro-batch's lets go here
            marker("output")
        if labels is None:
            loss = state.loss_of(output, state.batch)
        if settings.loop in LOOPS_BINDING_THE_LOSS:
            state.kept_loss = loss  # `loss = ...`: the previous micro-batch's graph goes as this binds
    if labels is not None:
        output = float32_outputs(output) if settings.is_amp else output
        loss = label_smoothed_loss(state.built_model, output, labels, settings.label_smoothing, counted)
    del inputs, labels, counted
    if settings.loop != "keep-output":
        del output
    marker("forward")
    if settings.loop == "zero-grad-before-backward" and current_grads(state) and not _accumulating(state):
        drop_grads(state)
        marker("zero_grad")
    if settings.grad_accum > 1 and engine is None:  # DeepSpeed's engine.backward divides by it itself
        loss = loss / settings.grad_accum
    reported = loss  # what transformers' Trainer returns from training_step, detached
    if state.loss_scale is not None:
        loss = loss * state.loss_scale
    if engine is not None:
        engine.backward(loss)
    else:
        loss.backward()
    del loss
    if settings.loop == "hf-trainer":
        state.kept_loss = reported.detach()
    del reported
    marker("backward")


def model_tensors(state: TrainingState) -> list[torch.Tensor]:
    return [*state.model.parameters(), *state.model.buffers()]


def _engine(state: TrainingState) -> Any:
    """A data-parallel wrapper that runs the backward and the step itself (DeepSpeed's engine), or None."""
    return state.data_parallel if hasattr(state.data_parallel, "step") else None


def optimizer_tensors(state: TrainingState) -> list[torch.Tensor]:
    """The optimizer's state, and GradScaler's scale and found-inf flag (amp-fp16)."""
    if (engine := _engine(state)) is not None:
        return engine.optimizer_tensors()
    scaler = [tensor for tensor in (state.loss_scale, state.found_inf) if tensor is not None]
    return optimizer_state_tensors(state.optimizer) + scaler


def communication_tensors(state: TrainingState) -> list[torch.Tensor]:
    """What a data-parallel wrapper holds beside the model: DDP's gradient buckets."""
    return state.data_parallel.buckets() if state.data_parallel is not None else []


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
        with warnings.catch_warnings():
            # FSDP2's gradients are DTensors, and the one-element found-inf flag beside them makes DTensor's
            # dispatch warn that it replicates it ("Found a non-scalar tensor with numel=1"): torch's GradScaler
            # does the same in a real run; it says nothing about the user's model.
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)
            for group in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(group, state.found_inf, inv_scale)
    if (engine := _engine(state)) is not None:
        engine.step()  # the optimizer over the rank's partition, and zero_grad, inside the engine
        state.kept_loss = None  # the iteration is over
        return grads
    loop = state.settings.loop
    if loop == "hf-trainer" and grads:
        torch.nn.utils.clip_grad_norm_(state.trainable, HF_TRAINER_MAX_GRAD_NORM)
    if state.optimizer is not None:
        state.optimizer.step()
        if loop in ("canonical", "hf-trainer", "keep-output"):  # the others zero before backward, or in place
            state.optimizer.zero_grad(set_to_none=True)
    state.kept_output = None  # keep-output's `del out` after the step
    if loop == "set-to-none-false":
        for grad in grads:
            grad.zero_()  # what zero_grad(set_to_none=False) does to each, also without an optimizer
    elif loop != "zero-grad-before-backward":
        drop_grads(state)
    state.kept_loss = None  # the iteration is over (tests/hand_measure.py's, a function's: its `loss` goes)
    return grads


def _accumulating(state: TrainingState) -> bool:
    """Inside an accumulation: a micro-batch after the first of its step has run its backward."""
    return state.micro_batches_done % state.settings.grad_accum != 0


def iteration(state: TrainingState, marker: Marker = no_marker) -> None:
    """One whole iteration of the training loop (used by real runs)."""
    if state.settings.step is not None:
        from memplan.estimator.user_step import custom_step  # built on this module's state and phases

        custom_step(state, marker)
        return
    engine = _engine(state)
    for index in range(state.settings.grad_accum):
        micro_batch(state, marker)
        state.micro_batches_done += 1
        if engine is not None and index < state.settings.grad_accum - 1:
            engine.after_micro_batch()
    optimizer_step(state)
