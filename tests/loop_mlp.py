"""A three-layer MLP (a ModuleList of three equal blocks, which --checkpoint all wraps, and a wide head) and its
batch and loss, for the hand-written loops of tests/test_loops.py."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, CLASSES = 128, 512


class ThreeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def three_layer() -> nn.Module:
    return ThreeLayer()


def rows(batch_size: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch_size, WIDTH), "labels": torch.randint(0, CLASSES, (batch_size,))}


def cross_entropy(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, batch["labels"])


SEQ, VOCAB = 32, 512


def tiny_gpt2_with_cache() -> nn.Module:
    """tests.zoo's tiny GPT-2 as a user's script builds it (`from_config`, `from_pretrained`): its config's
    `use_cache` on, GPT-2's default, so its output holds a key/value cache in training too."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from tests.zoo import TINY_HF_CONFIGS

    config = GPT2Config(**{key: value for key, value in TINY_HF_CONFIGS["gpt2"].items() if key != "model_type"})
    assert config.use_cache
    return AutoModelForCausalLM.from_config(config)


def tokens(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
