"""The math path of scaled_dot_product_attention holds its casts, its converted mask and its scaled query until it
returns (memplan.estimator.math_attention). On the CPU, dropout sends attention down that path.

Truth: the step run for real on the CPU (memplan.measure.cpu). Without the rule the two attention blocks below came
out 156,540 B of 2,129,792 low (7.4%) under CPU autocast, 159,612 B (7.5%) with a boolean mask, 281,732 B of
1,540,488 (18.3%) checkpointed under autocast, and 4,100 B checkpointed in float32 (the converted mask, alive in the
real run through the recomputed attention).
"""

import pytest
import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

HEADS, WIDTH = 4, 64


class Attention(nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.masked = masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, steps, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        mask = torch.ones(steps, steps, dtype=torch.bool).tril() if self.masked else None
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        return x + self.out(attended.transpose(1, 2).reshape(batch, steps, WIDTH))


class Blocks(nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(masked) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def attention() -> nn.Module:
    return Blocks(masked=False)


def masked_attention() -> nn.Module:
    return Blocks(masked=True)


def sequences(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 32, WIDTH)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.float().square().mean()


@pytest.mark.parametrize(
    ("model", "precision", "checkpoint"),
    [
        ("attention", "amp-bf16", "none"),
        ("masked_attention", "amp-bf16", "none"),
        ("masked_attention", "fp32", "all"),
        ("masked_attention", "amp-bf16", "all"),
    ],
)
def test_attention_with_dropout_on_the_cpu_is_its_real_run(model, precision, checkpoint):
    spec = resolve_model(
        f"tests.test_math_attention:{model}",
        inputs="tests.test_math_attention:sequences",
        loss="tests.test_math_attention:mean_square",
    )
    settings = TrainingSettings(batch_size=8, device="cpu", optimizer="sgd", precision=precision, checkpoint=checkpoint)
    settings = spec.settings_for(settings)
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    measured = measure_cpu(spec, settings).peak_bytes
    assert abs(predicted - measured) <= 8, f"predicted {predicted:,} B, measured {measured:,} B"
