"""Mixture-of-experts layers and their routing (memplan.estimator.routed_experts).

transformers' "grouped_mm" and "batched_mm" experts implementations size every tensor by tokens × top-k: the
prediction, made without values, is the real step's peak whatever the routing (checked here with every token routed
to the same experts). "eager" loops over the experts the batch hit, sized by the routing: a trace without values
cannot follow it, and the refusal says so and names the implementations it traces.
Truth: the same step run plainly on the CPU, measured by the allocator's events (tests/hand_measure.py)."""

from __future__ import annotations

import json

import pytest
import torch

from memplan.errors import TraceError
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_causal_lm_peak
from tests.test_oprules_grouped_mm import TINY_MIXTRAL

BATCH, SEQ_LEN = 2, 32


def _spec_and_settings(tmp_path, implementation: str):  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps({**TINY_MIXTRAL, "experts_implementation": implementation}))
    spec = resolve_model(str(tmp_path))
    return spec, spec.settings_for(TrainingSettings(batch_size=BATCH, seq_len=SEQ_LEN, device="cpu"))


def _one_token_batch() -> dict[str, torch.Tensor]:
    """Every position the same token: every token goes to the same top-k experts, the others get none."""
    input_ids = torch.full((BATCH, SEQ_LEN), 7)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_a_shape_only_experts_implementation_is_exact_under_the_most_skewed_routing(tmp_path, implementation):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec, settings = _spec_and_settings(tmp_path, implementation)
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    config = AutoConfig.for_model(**TINY_MIXTRAL, experts_implementation=implementation, use_cache=False)
    measured = profiled_causal_lm_peak(lambda: AutoModelForCausalLM.from_config(config), _one_token_batch)
    # within 8 B, as tests/test_oprules_grouped_mm.py: on one thread (tests/conftest.py) the run measured 4 B below
    # the prediction, on two exactly it
    assert abs(predicted - measured) <= 8


def test_eager_experts_are_refused_with_the_implementations_memplan_traces(tmp_path):
    """It said only "that model cannot be traced as the library runs it", though the same model traces with
    transformers' default experts implementation."""
    spec, settings = _spec_and_settings(tmp_path, "eager")
    with pytest.raises(TraceError) as refused:
        trace_step(spec, settings)
    message = str(refused.value)
    assert "experts_implementation" in message
    assert '"grouped_mm"' in message and '"batched_mm"' in message
