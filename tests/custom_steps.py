"""Training steps users write themselves, for `--step tests.custom_steps:NAME` (tests/test_custom_step.py).

Each is `fn(model, batch, optimizer)`, one iteration, written in plain PyTorch as a user would.
"""

from __future__ import annotations

import weakref

import torch


def two_views(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """Two forward passes of the batch, both graphs alive until one backward of the summed losses
    (a consistency loss's shape), then the step."""
    first = model(**batch)["loss"]
    second = model(**batch)["loss"]
    (first + second).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def zero_grad_first_and_log(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """zero_grad at the start (the previous gradients live until then), the loss read for logging."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch)["loss"]
    loss.backward()
    optimizer.step()
    _logged = float(loss.item())


def accumulate_halves(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The batch in two halves, each half's loss backward (accumulating), one step."""
    rows = next(iter(batch.values())).shape[0]
    for half in (slice(0, rows // 2), slice(rows // 2, rows)):
        loss = model(**{name: value[half] for name, value in batch.items()})["loss"]
        (loss / 2).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def no_backward(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """A broken step for the error test: it indexes a Python list past its end."""
    [][0]


def with_lr_schedule(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The canonical step with a learning-rate schedule kept on the optimizer (LR schedulers wrap
    optimizer.step as a bound method)."""
    if not hasattr(optimizer, "memplan_test_schedule"):
        optimizer.memplan_test_schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model(**batch)["loss"].backward()
    optimizer.step()
    optimizer.memplan_test_schedule.step()
    optimizer.zero_grad(set_to_none=True)


def keep_gradients(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """Gradients zeroed in place, never freed (zero_grad(set_to_none=False))."""
    model(**batch)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def canonical(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The loop most scripts write: forward, backward, step, zero_grad."""
    model(**batch)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def own_adam(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The step's own optimizer, made at its first call and kept on the model (memplan's is left unused)."""
    if not hasattr(model, "memplan_test_adam"):
        model.memplan_test_adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(**batch)["loss"].backward()
    model.memplan_test_adam.step()
    model.memplan_test_adam.zero_grad(set_to_none=True)


def by_hand(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """SGD written out: each weight updated from its gradient, then the gradients freed."""
    model(**batch)["loss"].backward()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(param.grad, alpha=-0.01)
    model.zero_grad(set_to_none=True)


def pop_ids_and_print(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """Takes what it needs out of the batch it is given (each step gets its own from a data loader) and logs."""
    ids = batch.pop("ids")
    loss = model(ids=ids)["loss"]
    print("step loss logged")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fresh_optimizer_state(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """Drops the optimizer's state first (a restart of its moments), which frees what the iteration began with."""
    optimizer.state.clear()
    model(**batch)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def auxiliary_loss_logged(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """A second forward whose loss is kept for logging and never backpropagated: its graph holds what it
    saved for backward until the step returns."""
    loss = model(**batch)["loss"]
    logged = model(**batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return logged


def forward_only(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """An evaluation written without no_grad: the graph lives until the step returns its loss."""
    return model(**batch)["loss"]


def clipped(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """Gradient clipping before the step, as HF's Trainer does by default (max_grad_norm 1.0)."""
    model(**batch)["loss"].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def adamw_made_in_the_step(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer made anew each call: its state is made in the step and held until the step returns."""
    own = torch.optim.AdamW(model.parameters())
    model(**batch)["loss"].backward()
    own.step()
    own.zero_grad(set_to_none=True)


def gradients_by_autograd_grad(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The gradients from torch.autograd.grad, set on the parameters by hand, then the optimizer's step."""
    params = [param for param in model.parameters() if param.requires_grad]
    for param, gradient in zip(params, torch.autograd.grad(model(**batch)["loss"], params), strict=True):
        param.grad = gradient
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def with_a_closure(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The forward and backward in the closure the optimizer's step calls (as LBFGS needs)."""

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch)["loss"]
        loss.backward()
        return loss

    optimizer.step(closure)
    optimizer.zero_grad(set_to_none=True)


def canonical_under_cuda_autocast(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The canonical loop's iteration, its forward under the CUDA autocast a script opens itself."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def canonical_under_default_cuda_autocast(
    model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer
) -> None:
    """The same with `torch.cuda.amp.autocast()`'s defaults: float16 on CUDA."""
    with torch.autocast("cuda"):
        loss = model(**batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def with_a_grad_scaler(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The usual mixed-precision recipe with an enabled GradScaler (CPU's): scale, backward, unscale, clip, step
    through the scaler, update. The scaler lives on the model, made at the first call."""
    if not hasattr(model, "grad_scaler"):
        model.grad_scaler = torch.amp.GradScaler("cpu")
    scaler = model.grad_scaler
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch)["loss"]
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def two_optimizers_of_its_own(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """Optimizers the step makes at its first call and keeps on the model (memplan's is not used): their state lives
    from one call to the next."""
    if not hasattr(model, "own_optimizers"):
        params = list(model.parameters())
        model.own_optimizers = (torch.optim.AdamW(params[:1]), torch.optim.SGD(params[1:], lr=0.1, momentum=0.9))
    loss = model(**batch)["loss"]
    loss.backward()
    for own in model.own_optimizers:
        own.step()
        own.zero_grad(set_to_none=True)


def keeps_its_output_graph(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The step's output kept on the model for the next call (for a metric), its graph with it: the previous call's
    graph lives until the step replaces it, at its end."""
    output = model(**batch)
    output["loss"].backward(retain_graph=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.last_output = output["logits"]


def logs_with_float(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The canonical step, its loss logged with float(), as many scripts log."""
    loss = model(**batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _logged = float(loss)


def with_lbfgs(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """torch's LBFGS, made at the first call: it tests its gradient against a tolerance (`if opt_cond:`)."""
    if not hasattr(model, "lbfgs"):
        model.lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=2)

    def closure() -> torch.Tensor:
        model.lbfgs.zero_grad()
        loss = model(**batch)["loss"]
        loss.backward()
        return loss

    model.lbfgs.step(closure)


def trims_padding(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """The batch cut to its longest row, a length read with int(): a size only values give."""
    longest = int(batch["ids"].ne(0).sum(-1).max())
    loss = model(ids=batch["ids"][:, :longest])["loss"]
    loss.backward()


def gradient_penalty(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """A gradient penalty (WGAN-GP, R1): the gradient of the output with respect to the input, made with
    create_graph=True, enters the loss, so the backward also runs the backward of the first backward."""
    x = batch["x"].clone().requires_grad_(True)
    out = model(x=x)
    (grad_x,) = torch.autograd.grad(out["score"].sum(), x, create_graph=True)
    (out["loss"] + grad_x.pow(2).sum(1).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# What a step keeps beside the model from one call to the next (an average of its weights), by model.
_AVERAGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ema_by_averaged_model(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """An exponential average of the weights by torch.optim.swa_utils.AveragedModel (its `avg_fn` way: per parameter,
    `decay * ema + (1 - decay) * param` copied in), made at the first call from a deepcopy of the model, updated
    after the step."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    if model not in _AVERAGES:
        _AVERAGES[model] = AveragedModel(model, avg_fn=get_ema_avg_fn(0.999))
    model(**batch)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _AVERAGES[model].update_parameters(model)


def ema_after_zero_grad(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """An average of the weights kept in a list, updated out of place after zero_grad has freed the gradients."""
    if model not in _AVERAGES:
        with torch.no_grad():
            _AVERAGES[model] = [param.detach().clone() for param in model.parameters()]
    model(**batch)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for average, param in zip(_AVERAGES[model], model.parameters(), strict=True):
            average.copy_(0.999 * average + 0.001 * param)


def clipped_failing_on_nonfinite(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """Clipping that raises on a non-finite norm (`error_if_nonfinite=True`: torch tests the norm with bool())."""
    model(**batch)["loss"].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def class_weighted_smoothed_loss(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """A causal LM's logits into a class-weighted, label-smoothed cross-entropy of the step's own: the log-softmax's
    output is read by the NLL loss and by the smoothing term's `input * weight`, so the engine sums two logits-sized
    gradients, in place in a plain run (torch/csrc/autograd/input_buffer.cpp, `accumulate`)."""
    logits = model(input_ids=batch["input_ids"]).logits
    classes = logits.shape[-1]
    weight = torch.linspace(0.5, 1.5, classes, device=logits.device)
    loss = torch.nn.functional.cross_entropy(
        logits.view(-1, classes), batch["labels"].view(-1), weight=weight, label_smoothing=0.1
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def gan_without_detach(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """A GAN's iteration with the fake batch not detached: the discriminator's backward also reaches the generator,
    adding into the gradients the generator's step left at the last call, which its zero_grad then drops. Two Adams of
    its own, made at the first call (memplan's optimizer is not used)."""
    if not hasattr(model, "gan_optimizers"):
        model.gan_optimizers = (
            torch.optim.Adam(model.generator.parameters()),
            torch.optim.Adam(model.discriminator.parameters()),
        )
    generator_optimizer, discriminator_optimizer = model.gan_optimizers
    fake = model.generator(batch["noise"])
    discriminator_optimizer.zero_grad()
    real_score = model.discriminator(batch["real"])
    fake_score = model.discriminator(fake)
    (torch.nn.functional.softplus(fake_score).mean() + torch.nn.functional.softplus(-real_score).mean()).backward(
        retain_graph=True
    )
    discriminator_optimizer.step()
    generator_optimizer.zero_grad()
    discriminator_optimizer.zero_grad()
    torch.nn.functional.softplus(-model.discriminator(fake)).mean().backward()
    generator_optimizer.step()
