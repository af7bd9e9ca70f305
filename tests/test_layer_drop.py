"""memplan.estimator.layer_drop: transformers' LayerDrop (`dropout_probability = torch.rand([])`, then `if
dropout_probability < self.layerdrop`) is traced with every layer run, against the same BART step run for real on the
CPU with every layer kept (a drop rate of 1e-4, whose draws drop none here, checked), measured by the CPU allocator's
events. Before it, a BART step could not be traced at all on transformers 5.17 (which draws in every training
forward) and, on 5.25, one whose config sets a drop rate."""

from __future__ import annotations

import json

import torch

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_causal_lm_peak

BATCH, SEQ_LEN = 2, 16
BART = {
    "model_type": "bart",
    "architectures": ["BartForConditionalGeneration"],
    "vocab_size": 256,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
    "encoder_layerdrop": 1e-4,  # above 0: transformers 5.25 draws (it skips the draw at 0), 5.17 draws anyway
    "decoder_layerdrop": 1e-4,
}


def test_a_layerdrop_step_is_traced_with_every_layer_run(tmp_path):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    layers_run: list[str] = []

    def model_of() -> torch.nn.Module:
        model = AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model(**BART, use_cache=False))
        for name, module in model.named_modules():
            if name.endswith(tuple(f"layers.{index}" for index in range(2))):
                module.register_forward_pre_hook(lambda *_, name=name: layers_run.append(name))
        return model

    def batch_of() -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, BART["vocab_size"], (BATCH, SEQ_LEN)),
            "labels": torch.randint(0, BART["vocab_size"], (BATCH, SEQ_LEN)),
        }

    measured = profiled_causal_lm_peak(model_of, batch_of)
    assert len(layers_run) == 3 * 4, "the seed's draws dropped a layer: the measurement is not of every layer"
    (tmp_path / "config.json").write_text(json.dumps(BART))
    spec = resolve_model(str(tmp_path))
    settings = spec.settings_for(TrainingSettings(batch_size=BATCH, seq_len=SEQ_LEN, device="cpu", optimizer="adamw"))
    assert simulate(trace_step(spec, settings)).peak_bytes == measured


class _CoinFlip(torch.nn.Module):
    """A draw whose `<` means "keep" here: not transformers' LayerDrop, so not answered."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand([]) < 0.5:
            x = self.linear(x)
        return x.square().mean()


def test_a_draw_compared_outside_transformers_modelling_code_is_still_refused():
    import pytest

    from memplan.errors import TraceError
    from tests.module_specs import loss_returning_spec

    spec = loss_returning_spec("coin-flip", _CoinFlip, (4,))
    with pytest.raises(TraceError, match="depends on tensor values"):
        trace_step(spec, TrainingSettings(batch_size=2, device="cpu"))
