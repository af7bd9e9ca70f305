"""memplan.estimator.oprules.grouped_mm: `torch._grouped_mm` (transformers' mixture-of-experts layers) traced as the
real kernel runs it.

Truth: the CPU kernel itself on real tensors (GroupedMMUtils.h, shared with CUDA's kernel), and a Mixtral step run
for real on the CPU (memplan.measure.cpu)."""

from __future__ import annotations

import json

import pytest
import torch

from memplan.estimator.fake_mode import TracingFakeMode
from memplan.estimator.oprules import FAKE_KERNEL_RULES
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

GROUPED_MM = torch.ops.aten._grouped_mm.default
OFFSETS = [3, 7, 16]


def _operands(layout: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """16 tokens in three groups; outputs 10 wide, which the kernel pads."""
    offs = torch.tensor(OFFSETS, dtype=torch.int32)
    if layout == "2d x 3d":  # the experts' forward: tokens × each expert's [in, out] weight, stored [out, in]
        return torch.randn(16, 8).to(dtype), torch.randn(3, 10, 8).to(dtype).transpose(-2, -1), offs
    if layout == "2d x 2d":  # their weights' gradient: [in, tokens] × [tokens, out] per group
        return torch.randn(16, 8).to(dtype).t(), torch.randn(10, 16).to(dtype).t(), offs
    if layout == "3d x 2d":
        return torch.randn(3, 6, 8).to(dtype), torch.randn(8, 16).to(dtype), offs
    return torch.randn(3, 6, 8).to(dtype), torch.randn(3, 10, 8).to(dtype).transpose(-2, -1), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["2d x 3d", "2d x 2d", "3d x 2d", "3d x 3d"])
def test_the_output_is_laid_out_as_the_real_kernel_lays_it_out(layout, dtype):
    """Rows padded to 16 bytes on every build: a [16, 10] float32 output has row stride 12 (torch's meta kernel
    says 10 on a CPU build and refuses float32 and float16 outright)."""
    mat_a, mat_b, offs = _operands(layout, dtype)
    real = GROUPED_MM(mat_a, mat_b, offs)
    with TracingFakeMode(allow_non_fake_inputs=True) as mode:
        fake = GROUPED_MM(*(mode.from_tensor(t) if t is not None else None for t in (mat_a, mat_b, offs)))
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()


@pytest.mark.parametrize(
    ("mat_a", "mat_b", "offs"),
    [
        (torch.randn(12, 6), torch.randn(3, 6, 8), [3, 7, 12]),  # a row of 24 B: not a multiple of 16
        (torch.randn(12, 8, dtype=torch.float64), torch.randn(3, 8, 8, dtype=torch.float64), [3, 7, 12]),
        (torch.randn(12, 8), torch.randn(3, 8, 8), None),  # a 2-D operand without offsets
        (torch.randn(12, 8), torch.randn(4, 8, 8), [3, 7, 12]),  # three groups, four experts
    ],
)
def test_what_the_real_kernel_refuses_the_rule_refuses(mat_a, mat_b, offs):
    offsets = torch.tensor(offs, dtype=torch.int32) if offs is not None else None
    with pytest.raises(RuntimeError):
        GROUPED_MM(mat_a, mat_b, offsets)
    with pytest.raises(RuntimeError):
        FAKE_KERNEL_RULES[GROUPED_MM]((mat_a, mat_b, offsets), {})


TINY_MIXTRAL = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_a_mixtral_step_traces_and_matches_its_real_run(tmp_path, precision):
    """transformers 5 runs Mixtral's experts with torch._grouped_mm in the weights' dtype (float32 here, also under
    autocast, which does not cover the op): memplan failed to trace it ("Expected inputs of BF16 type")."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_MIXTRAL))
    spec = resolve_model(str(tmp_path))
    settings = spec.settings_for(TrainingSettings(batch_size=2, seq_len=32, device="cpu", precision=precision))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert abs(predicted - measure_cpu(spec, settings).peak_bytes) <= 8
