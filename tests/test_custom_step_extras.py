"""What training loops add around forward, backward and step, in a user's `--step`: predicted against the same
function run plainly on the CPU (no dispatch mode), measured by the CPU allocator's events (tests/hand_measure.py),
model, optimizer and batch made inside the measured run."""

from __future__ import annotations

import pytest
import torch

import tests.custom_steps as custom_steps
import tests.zoo_models as zoo_models
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak

BATCH = 4


def _measured(name: str, optimizer_name: str) -> int:
    step = getattr(custom_steps, name)

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = zoo_models.squared_linears()
        parameters = model.parameters()
        optimizer = torch.optim.AdamW(parameters) if optimizer_name == "adamw" else torch.optim.SGD(parameters, lr=1e-2)
        batch = zoo_models.named_features(BATCH)
        build.kept = (model, optimizer, batch)  # type: ignore[attr-defined]
        return lambda: step(model, batch, optimizer)

    return profiled_third_iteration_peak(build)


def _predicted(name: str, optimizer_name: str) -> int:
    spec = resolve_model("tests.zoo_models:squared_linears", inputs="tests.zoo_models:named_features")
    step = f"tests.custom_steps:{name}"
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer=optimizer_name, step=step)
    return simulate(trace_step(spec, spec.settings_for(settings))).peak_bytes


@pytest.mark.parametrize(
    ("name", "optimizer_name"),
    [
        # OptimizerLocals (memplan.estimator.held_tensors) kept the optimizer's locals, the gradients among them,
        # as tensors until the step returned: what the step ran after its zero_grad found the gradients still
        # there (+786,420 B, the three gradients, here).
        ("ema_after_zero_grad", "adamw"),
        # AveragedModel deepcopies the model: the copy's fake tensors went to another FakeTensorMode, counted as
        # constants live through the step and again as each op's conversion of them, each until its own update.
        # With SGD (no state) the update is the step's peak.
        ("ema_by_averaged_model", "sgd"),
        ("ema_by_averaged_model", "adamw"),
        # torch tests the norm with bool() (`error_if_nonfinite`): refused as data-dependent, the user's code blamed.
        ("clipped_failing_on_nonfinite", "adamw"),
    ],
)
def test_a_step_with_a_loops_extras_is_predicted_as_measured(name, optimizer_name):
    assert _predicted(name, optimizer_name) == _measured(name, optimizer_name)
