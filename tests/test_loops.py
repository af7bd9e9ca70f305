"""`--loop`: each training loop people write, predicted against the same loop written out by hand
in plain PyTorch and run for real on the CPU (memplan's own loop code is on neither side)."""

from __future__ import annotations

import functools

import pytest
import torch

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import LOOPS, TrainingSettings
from tests.hand_measure import measured_step_peak
from tests.zoo_models import tied_lm, token_inputs

BATCH = 8


def _step(loop: str, model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """One training step as each loop's users write it."""
    if loop == "canonical":
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elif loop == "zero-grad-before-backward":
        loss = model(**batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    elif loop == "set-to-none-false":
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    elif loop == "hf-trainer":
        model(**batch)["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.zero_grad()
    elif loop == "keep-output":
        outputs = model(**batch)
        outputs["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        del outputs
    else:
        raise AssertionError(loop)


def _measured_peak(loop: str) -> int:
    torch.manual_seed(0)
    model = tied_lm()
    optimizer = torch.optim.AdamW(model.parameters())
    return measured_step_peak(functools.partial(_step, loop), model, token_inputs(BATCH), optimizer)


def _predicted_peak(loop: str) -> int:
    spec = resolve_model("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs")
    settings = spec.settings_for(TrainingSettings(batch_size=BATCH, device="cpu", loop=loop))
    return simulate(trace_step(spec, settings)).peak_bytes


@pytest.mark.parametrize("loop", LOOPS)
def test_each_loop_predicted_as_measured(loop):
    measured = _measured_peak(loop)
    assert _predicted_peak(loop) == pytest.approx(measured, rel=0.005, abs=16)


def test_the_loops_differ_where_they_should():
    # Measured, not predicted: the variants are worth telling apart on this model.
    peaks = {loop: _measured_peak(loop) for loop in LOOPS}
    assert peaks["set-to-none-false"] > peaks["canonical"]
    assert peaks["keep-output"] > peaks["canonical"]


def test_zero_grad_before_backward_starts_with_the_previous_gradients():
    # Its peak here falls where canonical's does; what differs is the forward, which runs with the
    # previous step's gradients still allocated: one float32 gradient per parameter.
    gradient_bytes = sum(param.numel() * 4 for param in tied_lm().parameters())
    spec = resolve_model("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs")
    starts = {
        loop: simulate(trace_step(spec, TrainingSettings(batch_size=BATCH, device="cpu", loop=loop))).timeline_bytes[0]
        for loop in ("canonical", "zero-grad-before-backward")
    }
    assert starts["zero-grad-before-backward"] - starts["canonical"] == gradient_bytes
