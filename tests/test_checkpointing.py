"""Checkpoint layouts on real models: same gradients as without, clear errors for impossible layouts."""

import pytest
import torch
from torch import nn

from memplan.errors import SettingsError
from memplan.estimator.checkpointing import SegmentError, apply_layout, block_names
from memplan.estimator.loop import micro_batch, prepare
from memplan.models.source import resolve_model
from memplan.settings import CheckpointLayout, TrainingSettings


def _gradients(spec, settings):
    torch.manual_seed(0)
    state = prepare(spec, settings)
    torch.manual_seed(1)
    state.batch = spec.make_batch(settings, torch.float32)
    micro_batch(state)
    return [param.grad.clone() for param in state.trainable]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_segment_checkpoint_gives_the_same_gradients(model, tiny_model_dirs):
    spec = resolve_model(str(tiny_model_dirs[model]))
    settings = spec.settings_for(TrainingSettings(batch_size=2, seq_len=32, device="cpu"))
    torch.manual_seed(0)
    blocks = block_names(prepare(spec, settings).model)
    reference = _gradients(spec, settings)
    segmented = _gradients(spec, settings.replace(checkpoint=CheckpointLayout(segments=(tuple(blocks),))))
    assert len(reference) == len(segmented)
    for expected, actual in zip(reference, segmented, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


class _Scaled(nn.Module):
    """The parent changes the hidden state between blocks, so two blocks cannot share a checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * 2
        return x


def test_a_segment_whose_blocks_are_not_chained_is_refused():
    model = _Scaled()
    apply_layout(model, CheckpointLayout(segments=(("blocks.0", "blocks.1"),)))
    with pytest.raises(SegmentError, match="checkpoint its blocks one by one"):
        model(torch.randn(3, 8, requires_grad=True)).sum().backward()


def test_layout_errors_name_the_problem():
    model = _Scaled()
    with pytest.raises(SettingsError, match="does not have"):
        apply_layout(model, CheckpointLayout(segments=(("blocks.7",),)))
    with pytest.raises(SettingsError, match="consecutive blocks"):
        apply_layout(nn.Sequential(_Scaled(), _Scaled()), CheckpointLayout(segments=(("0.blocks.1", "1.blocks.0"),)))
    with pytest.raises(SettingsError, match="checkpointed twice"):
        CheckpointLayout(segments=(("blocks.0",), ("blocks.0", "blocks.1")))


def test_undo_restores_the_plain_forward():
    model = _Scaled()
    undo = apply_layout(model, CheckpointLayout(segments=(("blocks.0",), ("blocks.1",))))
    assert "forward" in vars(model.blocks[0])
    undo()
    assert "forward" not in vars(model.blocks[0])
