"""Optimizer state bytes against the optimizer itself: the test builds each torch.optim optimizer
as a user would, takes one real step, and counts the bytes of the real `optimizer.state`
(memplan's optimizer construction and loop are on neither side). adam8bit has no such truth
here: bitsandbytes is not installed, and memplan's layout of it is its own reading."""

from __future__ import annotations

import pytest
import torch

from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.zoo_models import tied_lm, token_inputs

USER_OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
}


def _real_state_bytes(name: str) -> int:
    torch.manual_seed(0)
    model = tied_lm()
    optimizer = USER_OPTIMIZERS[name](model.parameters())
    model(**token_inputs(4))["loss"].backward()
    optimizer.step()
    storages = {
        value.untyped_storage()._cdata: value.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    }
    return sum(storages.values())


def _predicted_state_bytes(name: str) -> int:
    spec = resolve_model("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs")
    traced = trace_step(spec, TrainingSettings(batch_size=4, device="cpu", optimizer=name))
    return sum(
        traced.storage_bytes[key]
        for key, category in traced.storage_categories.items()
        if category == "optimizer_state"
    )


@pytest.mark.parametrize("name", sorted(USER_OPTIMIZERS))
def test_optimizer_state_bytes_are_the_real_optimizers(name):
    real = _real_state_bytes(name)
    assert _predicted_state_bytes(name) == real
    if name == "sgd":
        assert real == 0  # plain SGD keeps no state: the case that tells a missing buffer apart
    else:
        assert real > 0
