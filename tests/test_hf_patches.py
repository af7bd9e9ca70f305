"""memplan.estimator.hf_patches: transformers takes, under fake tensors, the path a real run takes.

Truth: the step run for real on the CPU (memplan.measure.cpu)."""

import json

import torch

from memplan.estimator.hf_patches import made_of_ones
from memplan.estimator.recorder import GraphRecorder
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

TINY_BART = {
    "model_type": "bart",
    "architectures": ["BartForConditionalGeneration"],
    "vocab_size": 1000,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 64,
}


def test_a_decoder_that_makes_its_padding_mask_of_ones_skips_the_causal_mask_as_a_real_run_does(tmp_path):
    """BART's decoder makes its padding mask with torch.ones where none is given; transformers reads any fake tensor
    as a traced graph and built a float causal mask per layer, which a real run skips for SDPA's is_causal: the
    prediction was 32,764 B high at batch 4 (a helper's bug hunt)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_BART))
    spec = resolve_model(str(tmp_path))
    settings = spec.settings_for(TrainingSettings(batch_size=4, seq_len=32, device="cpu", optimizer="sgd"))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert abs(predicted - measure_cpu(spec, settings).peak_bytes) <= 8


def test_only_what_the_graph_made_of_ones_is_all_ones():
    with GraphRecorder() as recorder:
        ones = torch.ones(4, 32).to(torch.bool)[:, :16]
        full = torch.full((4, 32), 1.0)
        zeros = torch.zeros(4, 32).to(torch.bool)
        twos = torch.full((4, 32), 2.0)
    assert made_of_ones(ones, recorder.tensor_nodes) and made_of_ones(full, recorder.tensor_nodes)
    assert not made_of_ones(zeros, recorder.tensor_nodes) and not made_of_ones(twos, recorder.tensor_nodes)
    assert not made_of_ones(torch.ones(2), recorder.tensor_nodes)  # made outside the recording: not known


def test_a_modeling_module_with_a_placeholder_for_a_missing_backend_does_not_fail_later_traces(monkeypatch):
    """transformers defines a placeholder class where a module's backend is missing (an image processor's without
    torchvision, as on torch 2.11's stack): its metaclass raises ImportError at any attribute asked of it. Once such a
    module had been imported, every later estimate in the process failed ("cannot trace ...: ImportError")."""
    import sys
    from types import ModuleType

    import memplan

    class Placeholder(type):
        """transformers.utils.import_utils.DummyObject's refusal, without depending on which backends are missing here:
        any attribute not starting with an underscore raises ImportError (requires_backends)."""

        def __getattribute__(cls, key: str) -> object:
            if key.startswith("_"):
                return super().__getattribute__(key)
            raise ImportError(f"{type.__getattribute__(cls, '__name__')} requires the Torchvision library")

    module = ModuleType("transformers.models.memplan_probe.image_processing_memplan_probe")
    module.ProbeImageProcessor = Placeholder("ProbeImageProcessor", (), {})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    estimate = memplan.estimate("tiny-gpt2", batch_size=2, seq_len=16, device="cpu")
    assert estimate.peak_bytes > 0
