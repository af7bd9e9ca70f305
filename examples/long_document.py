"""The long-document classifier from design.md §6: DistilBERT over 10 chunks of 512 tokens per document.

Each document is split into chunks; DistilBERT encodes every chunk, a small head classifies the
mean of the chunks' first-token vectors. Batch 2 documents = 20 sequences of 512 tokens through
DistilBERT, which is where the author's "~6 GB jump in the forward pass" came from.

    memplan plan examples.long_document:build --inputs examples.long_document:inputs \\
        --loss examples.long_document:loss -b 2 --budget 16GiB
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DistilBertConfig, DistilBertModel

CHUNKS = 10
CHUNK_TOKENS = 512
LABELS = 2


class LongDocumentClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = DistilBertConfig()  # distilbert-base-uncased: 6 blocks, width 768, vocab 30522
        self.encoder = DistilBertModel(config)
        self.head = nn.Sequential(nn.Linear(config.dim, 256), nn.ReLU(), nn.Linear(256, LABELS))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        documents, chunks, tokens = input_ids.shape
        encoded = self.encoder(
            input_ids=input_ids.reshape(documents * chunks, tokens),
            attention_mask=attention_mask.reshape(documents * chunks, tokens),
        ).last_hidden_state[:, 0]
        return self.head(encoded.reshape(documents, chunks, -1).mean(dim=1))


def build() -> nn.Module:
    return LongDocumentClassifier()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    shape = (batch_size, CHUNKS, CHUNK_TOKENS)
    return {
        "input_ids": torch.randint(0, 30522, shape),
        "attention_mask": torch.ones(shape, dtype=torch.long),
    }


def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = torch.zeros(logits.shape[0], dtype=torch.long)
    return F.cross_entropy(logits, labels)
