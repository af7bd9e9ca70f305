"""In-place ops in a custom model's forward: legal ones predicted as measured, one that breaks the backward refused.

Truth: the same step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's own events
(tests/hand_measure.py), AdamW over the parameters that require grad. Before SavedTensors checked the version counter
as SavedVariable::unpack does, a forward whose in-place op changed a tensor saved for backward (the real run fails)
was predicted as if it ran."""

from __future__ import annotations

import pytest
import torch

import tests.partial_training_models as models
from memplan.errors import TraceError
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration

BATCH = 512
SETTINGS = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="adamw")


def _spec(name: str):
    return resolve_model(f"tests.partial_training_models:{name}", inputs="tests.partial_training_models:rows")


def _plain_run_peak(name: str) -> int:
    def build():
        torch.manual_seed(0)
        model = getattr(models, name)()
        optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad])
        return training_iteration(model, models.rows(BATCH), lambda out, _: out, optimizer)

    return profiled_third_iteration_peak(build)


def test_legal_in_place_ops_are_predicted_as_measured():
    name = "residual_in_place"
    measured = _plain_run_peak(name)
    spec = _spec(name)
    assert simulate(trace_step(spec, spec.settings_for(SETTINGS))).peak_bytes == measured
    assert measure_cpu(spec, spec.settings_for(SETTINGS)).peak_bytes == measured


def test_an_in_place_op_on_a_tensor_saved_for_backward_is_refused_as_torch_refuses_it():
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _plain_run_peak("residual_scaled_after_relu")
    spec = _spec("residual_scaled_after_relu")
    with pytest.raises(TraceError, match="modified by an inplace operation"):
        trace_step(spec, spec.settings_for(SETTINGS))


@pytest.mark.parametrize("name", ["frozen_norm_backbone", "frozen_backbone_trained_norms"])
def test_modules_a_models_own_train_keeps_in_eval_mode_stay_there(name):
    """memplan puts the model in training mode with `model.train()`, as the script's loop does, so a backbone whose
    `train()` override keeps its batch norm and dropout in eval mode (norm_eval) is traced in eval mode, and one
    without is trained: each as its plain run, whose `model.train()` runs the same override. (The two differ:
    dropout's mask and batch norm's batch statistics are held only in training mode.)"""

    def build():
        torch.manual_seed(0)
        model = getattr(models, name)()
        model.train()
        optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad])
        return training_iteration(model, models.rows(BATCH), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = _spec(name)
    assert simulate(trace_step(spec, spec.settings_for(SETTINGS))).peak_bytes == measured
