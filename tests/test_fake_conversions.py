"""Model factories that convert their own model (.half(), .to(torch.bfloat16), .cuda()) are taken
as given: traced under fake tensors, and predicted as a real CPU run of them measures."""

import pytest
import torch

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.zoo_models import FEATURES

PARAMETERS = FEATURES * FEATURES + FEATURES + FEATURES * 4 + 4  # the two Linear layers


def _spec(factory: str, inputs: str = "flat_inputs"):
    return resolve_model(
        f"tests.zoo_models:{factory}",
        inputs=f"tests.zoo_models:{inputs}",
        loss="tests.zoo_models:float_mean_square_loss",
    )


@pytest.mark.parametrize(
    ("factory", "inputs", "dtype"),
    [("half_factory", "half_inputs", torch.float16), ("bfloat16_factory", "bfloat16_inputs", torch.bfloat16)],
)
def test_a_factory_that_converts_its_model_is_predicted_as_measured(factory, inputs, dtype):
    spec = _spec(factory, inputs)
    settings = spec.settings_for(TrainingSettings(batch_size=8, device="cpu", optimizer="sgd"))
    traced = trace_step(spec, settings)
    parameter_bytes = sum(
        traced.storage_bytes[key] for key, category in traced.storage_categories.items() if category == "parameters"
    )
    assert parameter_bytes == PARAMETERS * dtype.itemsize
    measured = measure_cpu(spec, settings).peak_bytes
    assert simulate(traced).peak_bytes == pytest.approx(measured, rel=0.005)


def test_a_factory_that_moves_its_model_to_cuda_is_traced_on_the_target():
    spec = _spec("cuda_factory")
    traced = trace_step(spec, spec.settings_for(TrainingSettings(batch_size=8, device="cuda", optimizer="sgd")))
    assert all(
        node.meta["val"].device.type != "cuda"
        for node in traced.graph.nodes
        if "val" in node.meta and isinstance(node.meta["val"], torch.Tensor)
    )
    parameter_bytes = sum(
        traced.storage_bytes[key] for key, category in traced.storage_categories.items() if category == "parameters"
    )
    assert parameter_bytes == PARAMETERS * 4
