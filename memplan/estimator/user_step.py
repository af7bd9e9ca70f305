"""A custom step (`--step package.module:fn`, settings.step) in place of the loop: memplan calls
`fn(model, batch, optimizer)` once per iteration, with the model, batch and optimizer built as for the loop
(memplan.estimator.loop.prepare), and marks its phases where the function calls them: the forward ends at its
first backward, the backward at its first optimizer step."""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from memplan.errors import UsageError
from memplan.estimator.fake_conversions import copies_stay_in_their_mode
from memplan.estimator.loop import Marker, TrainingState, current_grads, no_marker
from memplan.models.imports import import_object
from memplan.models.source import Batch, _check_signature
from memplan.settings import TrainingSettings

StepFunction = Callable[[nn.Module, Batch, Optimizer | None], Any]


def step_function(settings: TrainingSettings) -> StepFunction:
    assert settings.step is not None
    step = import_object(settings.step, "--step")
    needs = f"--step {settings.step} must take three arguments: the model, the batch and the optimizer"
    _check_signature(step, (None, None, None), UsageError, needs)
    return step


# Shown the gradients (and, at an optimizer's step, that optimizer): memplan.estimator.custom_step_trace.
GradientsSeen = Callable[[list[torch.Tensor], Any], None]


@contextlib.contextmanager
def _step_phases(state: TrainingState, marker: Marker, on_step: GradientsSeen | None) -> Iterator[None]:
    """Mark the forward's end at the first backward call (`loss.backward()`, `torch.autograd.backward` or
    `torch.autograd.grad`) and the backward's end at the first step of an optimizer (memplan's, or one the
    function makes itself: torch's global step pre-hook), showing `on_step` the gradients each backward leaves
    and those the step finds, with that optimizer (or, without a step, those the function leaves). `on_step`
    must not keep them: the step's own zero_grad frees them. A step given a closure (`optimizer.step(closure)`,
    as LBFGS needs) runs the forward and backward inside it: the backward ends when the closure returns, not
    when the step begins (torch calls its pre-hooks first). The phases decide which ops ran on the autograd
    engine's thread, and so how many cuBLAS workspaces the step holds (memplan.estimator.transients)."""
    marked: set[str] = set()
    original_backward = torch.autograd.backward
    original_grad = torch.autograd.grad

    def forward_ends() -> None:
        if not marked:
            marked.add("forward")
            marker("forward")

    def backward(*args: Any, **kwargs: Any) -> Any:
        forward_ends()
        returned = original_backward(*args, **kwargs)
        if on_step is not None:  # a function that updates the weights by hand, then frees .grad, has them here
            on_step(current_grads(state), None)
        return returned

    def grad(*args: Any, **kwargs: Any) -> Any:
        forward_ends()
        return original_grad(*args, **kwargs)

    optimizer = state.optimizer
    original_step = optimizer.step if optimizer is not None else None

    def stepping(stepped: Any) -> None:
        if "backward" not in marked:
            marked.update(("forward", "backward"))
            if on_step is not None:
                on_step(current_grads(state), stepped)
            marker("backward")

    def with_closure_marked(stepped: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The step's arguments with its closure (if any) marking the backward's end as it returns."""
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure) or "backward" in marked:
            return None

        def marked_closure() -> Any:
            returned = closure()
            stepping(stepped)
            return returned

        if "closure" in kwargs:
            return args, {**kwargs, "closure": marked_closure}
        return (marked_closure, *args[1:]), kwargs

    def step(*args: Any, **kwargs: Any) -> Any:
        assert original_step is not None
        closure_marked = with_closure_marked(optimizer, args, kwargs)
        if closure_marked is None:
            stepping(optimizer)
            return original_step(*args, **kwargs)
        return original_step(*closure_marked[0], **closure_marked[1])

    def any_step(stepped: Any, args: Any, kwargs: Any) -> tuple[tuple, dict] | None:
        if stepped is optimizer:  # memplan's (its step, above, marks it)
            return None
        closure_marked = with_closure_marked(stepped, args, kwargs)
        if closure_marked is None:
            stepping(stepped)
        return closure_marked  # torch calls the step with these arguments (a hook may return new ones)

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    any_step_hook = register_optimizer_step_pre_hook(any_step)

    torch.autograd.backward = backward  # Tensor.backward looks it up as torch.autograd.backward
    torch.autograd.grad = grad
    own_step = optimizer.__dict__.get("step") if optimizer is not None else None  # e.g. an LR scheduler's
    if optimizer is not None:
        # A bound method, as LR schedulers expect of optimizer.step (they wrap its __func__).
        optimizer.step = types.MethodType(lambda _optimizer, *args, **kwargs: step(*args, **kwargs), optimizer)
    try:
        yield
    finally:
        any_step_hook.remove()
        torch.autograd.backward = original_backward
        torch.autograd.grad = original_grad
        if optimizer is not None:
            if own_step is None:
                del optimizer.step  # back to the class's own method
            else:
                optimizer.step = own_step
    if "backward" not in marked and on_step is not None:
        on_step(current_grads(state), None)


def custom_step(state: TrainingState, marker: Marker = no_marker, on_step: GradientsSeen | None = None) -> None:
    """The user's iteration, `fn(model, batch, optimizer)`, with its phases marked."""
    function = step_function(state.settings)
    with _step_phases(state, marker, on_step), copies_stay_in_their_mode():
        function(state.model, _container_of_its_own(state.batch), state.optimizer)


def _container_of_its_own(batch: Batch) -> Batch:
    """The batch in a container of its own for each call, as a data loader hands each step a new one: a step
    may take what it needs out of it (`labels = batch.pop("labels")`), and the next call still finds it all.
    The tensors are the same ones (no allocation); the container keeps its type (a BatchEncoding stays one)."""
    return copy.copy(batch) if isinstance(batch, MutableMapping | list) else batch
