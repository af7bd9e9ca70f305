"""memplan.estimator.tensor_caches: transformers' lru caches of tensors, apart from the estimate's fake tensors.

Truth: the real step, run as in a fresh process (its caches empty before its first iteration), measured by the CPU
allocator's events (tests.hand_measure, oneDNN off)."""

import json

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForImageClassification
from transformers.models.beit import modeling_beit  # noqa: F401  (imported: its cache is there to empty)

from memplan.estimator.simulate import simulate
from memplan.estimator.tensor_caches import fresh_tensor_caches
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_causal_lm_peak

# BEiT's relative position bias indexes its table with generate_relative_position_index((4, 4)), an lru-cached
# [17, 17] int64 tensor (2,312 B) shared by every layer and every later step (modeling_beit.py).
TINY_BEIT = {
    "model_type": "beit",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "use_relative_position_bias": True,
    "use_mean_pooling": True,
    "num_labels": 10,
    "architectures": ["BeitForImageClassification"],
}


@pytest.fixture(autouse=True)
def as_in_a_fresh_process():  # type: ignore[no-untyped-def]
    """Each test starts with the caches empty, as a fresh process does, whatever an earlier test left in them."""
    with fresh_tensor_caches():
        yield


def _predicted(tmp_path, **overrides):  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps(TINY_BEIT))
    spec = resolve_model(str(tmp_path))
    settings = spec.settings_for(TrainingSettings(batch_size=2, image_size=32, device="cpu", **overrides))
    with torch.backends.mkldnn.flags(enabled=False):
        return simulate(trace_step(spec, settings)).peak_bytes


def _real_beit() -> torch.nn.Module:
    return AutoModelForImageClassification.from_config(AutoConfig.for_model(**TINY_BEIT)).train()


def test_a_real_model_trained_after_an_estimate_computes_on_real_tensors(tmp_path):
    """The estimate had left its fake index in transformers' cache: a real BEiT trained next in the same process
    indexed its bias table with it, and its loss was a FakeTensor, with no error (a helper's hunt, 2026-12-07)."""
    _predicted(tmp_path, optimizer="sgd")
    loss = _real_beit()(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.randint(0, 10, (2,))).loss
    assert type(loss) is torch.Tensor
    loss.backward()


def test_what_a_step_caches_is_held_through_the_optimizer_step(tmp_path):
    """A checkpointed BEiT with AdamW peaks in the optimizer step, where the real run still holds the cached index;
    the trace had freed it after the backward's last read: 2,308 B low (-0.50%)."""
    predicted = _predicted(tmp_path, optimizer="adamw", checkpoint="all")

    def model_of() -> torch.nn.Module:
        model = _real_beit()
        for layer in model.beit.layers:  # non-reentrant, as --checkpoint all and Hugging Face's own checkpointing
            layer.forward = lambda *a, forward=layer.forward, **k: checkpoint(forward, *a, use_reentrant=False, **k)
        return model

    def batch_of() -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 10, (2,))}

    measured = profiled_causal_lm_peak(model_of, batch_of)  # its first iteration makes the index, as in a fresh process
    assert abs(predicted - measured) <= 16, f"predicted {predicted:,} B, measured {measured:,} B"


def test_a_real_run_before_the_estimate_leaves_it_unchanged(tmp_path):
    """A real step first filled the cache with a real index, which the trace read as a constant the step had not
    made: a second estimate differed from the first by it."""
    first = _predicted(tmp_path, optimizer="sgd")
    model = _real_beit()
    model(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.randint(0, 10, (2,))).loss.backward()
    assert _predicted(tmp_path, optimizer="sgd") == first
