"""memplan.estimator.oprules.losses: the 0-d losses that keep the unreduced loss's storage.

Truth: the CPU kernels themselves on real tensors (the same structured code runs on CUDA: the module's
docstring), and a real CPU training step measured by its own storage counter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.oprules import OUTPUT_BYTES_RULES
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

aten = torch.ops.aten
F32, BF16 = torch.float32, torch.bfloat16
CASES = [
    # op, input shape and dtype, target shape and dtype, extra arguments (the reduction last where it goes there)
    (aten.mse_loss.default, ((4, 3, 8, 8), F32), ((4, 3, 8, 8), F32), (1,)),
    (aten.mse_loss.default, ((4, 3, 8, 8), F32), ((4, 3, 8, 8), F32), (2,)),  # sum
    (aten.mse_loss.default, ((4, 3, 8, 8), BF16), ((4, 3, 8, 8), F32), (1,)),  # promoted to float32
    (aten.mse_loss.default, ((4, 1, 8, 8), F32), ((1, 3, 8, 8), F32), (1,)),  # broadcast
    (aten.smooth_l1_loss.default, ((16, 7), F32), ((16, 7), F32), (1, 1.0)),
    (aten.smooth_l1_loss.default, ((16, 7), F32), ((16, 7), F32), (1, 0.0)),  # beta 0: l1_loss_out into it
    (aten.binary_cross_entropy.default, ((16, 7), F32), ((16, 7), F32), (None, 1)),
    (aten.soft_margin_loss.default, ((16, 7), BF16), ((16, 7), BF16), (2,)),
    (aten.mse_loss.default, ((16, 7), F32), ((16, 7), F32), (0,)),  # none: the loss itself
]


@pytest.mark.parametrize(("op", "input_spec", "target_spec", "extra"), CASES)
def test_the_loss_holds_the_storage_the_kernel_gives_it(op, input_spec, target_spec, extra):
    torch.manual_seed(0)
    (input_shape, input_dtype), (target_shape, target_dtype) = input_spec, target_spec
    input = torch.rand(input_shape).to(input_dtype)
    target = torch.rand(target_shape).to(target_dtype)
    real = op(input, target, *extra)
    assert OUTPUT_BYTES_RULES[op]((input, target, *extra), {}, "cpu") == [real.untyped_storage().nbytes()]


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 3 * 32 * 32)

    def forward(self, code: torch.Tensor, image: torch.Tensor) -> torch.Tensor:  # the image is the loss's
        return torch.sigmoid(self.up(code)).view(-1, 3, 32, 32)


def decoder() -> nn.Module:
    return Decoder()


def codes(batch_size: int) -> dict[str, torch.Tensor]:
    return {"code": torch.randn(batch_size, 16), "image": torch.rand(batch_size, 3, 32, 32)}


def mse(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(output, batch["image"])


def bce(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.binary_cross_entropy(output, batch["image"])


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_a_step_with_such_a_loss_is_its_real_run(loss):
    """The 0-d loss holds a [16, 3, 32, 32] float32 buffer (192 KiB) through the backward: 7-12% of this step."""
    spec = resolve_model(
        "tests.test_oprules_losses:decoder",
        inputs="tests.test_oprules_losses:codes",
        loss=f"tests.test_oprules_losses:{loss}",
    )
    settings = spec.settings_for(TrainingSettings(batch_size=16, device="cpu", optimizer="sgd"))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert abs(predicted - measure_cpu(spec, settings).peak_bytes) <= 8
