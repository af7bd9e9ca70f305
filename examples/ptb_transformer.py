"""The PTB Transformer language model from design.md §6 (the "needle" seed document).

Its authors trained a Transformer LM on Penn Treebank with batch 256, sequence length 20, hidden
size 32 and Adam, and built gradient checkpointing of LayerNorm, ReLU, Linear and attention by
hand. The seed gives no layer count or head count; this example assumes 4 layers of 4 heads with
the usual 4× feed-forward width, and PTB's 10,000-word vocabulary (Mikolov et al.'s split).

    memplan plan examples.ptb_transformer:build --inputs examples.ptb_transformer:inputs \\
        --loss examples.ptb_transformer:loss -b 256 --optimizer adam --budget 600MiB
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 10_000  # PTB (Mikolov et al. 2010 preprocessing)
SEQ_LEN = 20
HIDDEN = 32
LAYERS = 4  # assumed: the seed does not say
HEADS = 4  # assumed


class TransformerLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(SEQ_LEN, HIDDEN)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(HIDDEN, HEADS, dim_feedforward=4 * HIDDEN, batch_first=True)
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens[:, :-1]  # the batch holds SEQ_LEN + 1 tokens: inputs and next-token targets
        steps = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(steps, device=tokens.device)
        hidden = self.embedding(tokens) + self.position(torch.arange(steps, device=tokens.device))
        for layer in self.layers:
            hidden = layer(hidden, src_mask=causal, is_causal=True)
        return self.head(self.norm(hidden))


def build() -> nn.Module:
    return TransformerLM()


def inputs(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))


def loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
