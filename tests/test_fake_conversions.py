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


def transformer_encoder() -> torch.nn.Module:
    """nn.TransformerEncoder deep-copies its layer once per layer (torch/nn/modules/transformer.py, _get_clones)."""
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False))


def sequences(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16, 64)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.square().mean()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_layers_a_factory_deep_copies_are_counted_once(optimizer):
    """The copies' parameters are the model's: a copy's fake parameter once carried a copy of the fake mode, so each
    op converted it afresh and its weights were counted a second time (393,212 B here, in float32)."""
    spec = resolve_model(
        "tests.test_fake_conversions:transformer_encoder",
        inputs="tests.test_fake_conversions:sequences",
        loss="tests.test_fake_conversions:mean_square",
    )
    settings = spec.settings_for(TrainingSettings(batch_size=4, device="cpu", optimizer=optimizer))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert abs(predicted - measure_cpu(spec, settings).peak_bytes) <= 8


class _Orthogonal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.square, self.head = torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
        torch.nn.utils.parametrizations.orthogonal(self.square, orthogonal_map="cayley")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.square(x))).square().mean()


def orthogonal_model() -> torch.nn.Module:
    return _Orthogonal()


def features(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 32)


def test_an_orthogonal_parametrization_of_a_square_weight_builds_and_is_its_real_run():
    """`parametrizations.orthogonal` tests a square weight with `torch.allclose` to pick how it makes its `base`: under
    fake tensors the factory failed ("model factory ... raised DataDependentOutputException: aten.allclose.default
    ... fix it"). Truth: the step run for real, no dispatch mode active, by the CPU allocator's events."""
    from tests.hand_measure import profiled_third_iteration_peak, training_iteration

    def build():
        torch.manual_seed(0)
        model = _Orthogonal()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        return training_iteration(model, features(4), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = resolve_model("tests.test_fake_conversions:orthogonal_model", inputs="tests.test_fake_conversions:features")
    settings = spec.settings_for(TrainingSettings(batch_size=4, device="cpu", optimizer="sgd"))
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
