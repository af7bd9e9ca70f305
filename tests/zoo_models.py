"""Structurally awkward custom models for the accuracy zoo, importable as tests.zoo_models:NAME."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

FEATURES = 64


class ConvBNNet(nn.Module):
    """Conv + BatchNorm + in-place ReLU (in-place ops must not allocate)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(images), labels)


class TiedLM(nn.Module):
    """Output projection shares the embedding's weight."""

    def __init__(self, vocab: int = 500) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, FEATURES)
        self.mix = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), ids.flatten()), "logits": logits}


class ReusedBlock(nn.Module):
    """One block applied four times: its parameters once, its activations four times."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(FEATURES, 4 * FEATURES), nn.GELU(), nn.Linear(4 * FEATURES, FEATURES))
        self.out = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = x + self.block(x)
        return self.out(x)  # not a scalar: the zoo passes --loss


class LinearStack(nn.Module):
    """Plain Linear blocks in a ModuleList (what `--checkpoint all` wraps), wide enough that each
    block's weight copy under autocast is a visible share of the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU()) for _ in range(6))
        self.out = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class FrozenEncoder(nn.Module):
    """A frozen encoder feeding a trainable head: no gradients or optimizer state for the encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256))
        for param in self.encoder.parameters():
            param.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)).pow(2).mean()


class SquarePlusOne(torch.autograd.Function):
    """A custom autograd.Function that saves its input and a derived tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        doubled = 2 * x
        ctx.save_for_backward(doubled)
        return x * x + 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (doubled,) = ctx.saved_tensors
        return grad * doubled


class CustomFunctionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(FEATURES, 512)
        self.outer = nn.Linear(512, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(SquarePlusOne.apply(self.inner(x))).mean()


class LSTMTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, 96, num_layers=2, batch_first=True)
        self.head = nn.Linear(96, 5)

    def forward(self, x: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(x)
        return F.cross_entropy(self.head(hidden).flatten(0, 1), tags.flatten())


class DataDependent(nn.Module):
    """Branches on a tensor value: cannot be traced."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        score = self.gate(x).mean()
        if score.item() > 0:
            return score
        return -score


class WiderForLargeBatches(torch.nn.Module):
    """Its step is not the same requests at every batch size: above 6 samples it adds a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(64, 256)
        self.extra = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if x.shape[0] > 6:
            hidden = self.extra(hidden).relu()
        return hidden.square().mean()


def conv_bn_net() -> nn.Module:
    return ConvBNNet()


def conv_bn_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))


def tied_lm() -> nn.Module:
    return TiedLM()


def odd_vocab_lm() -> nn.Module:
    """TiedLM with 509 tokens: its embedding (32,576 elements) ends in a part of a 256-element block."""
    return TiedLM(vocab=509)


def token_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, 500, (batch_size, 48))}


def reused_block() -> nn.Module:
    return ReusedBlock()


def features_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 32, FEATURES)


def mean_square_loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def linear_stack() -> nn.Module:
    return LinearStack()


def frozen_encoder() -> nn.Module:
    return FrozenEncoder()


def custom_function_net() -> nn.Module:
    return CustomFunctionNet()


def lstm_tagger() -> nn.Module:
    return LSTMTagger()


def sequence_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 24, FEATURES), torch.randint(0, 5, (batch_size, 24))


def data_dependent() -> nn.Module:
    return DataDependent()


def inputs_without_batch_size() -> torch.Tensor:
    return torch.randn(2, FEATURES)


def _small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU(), nn.Linear(FEATURES, 4))


def half_factory() -> nn.Module:
    return _small_mlp().half()  # factories convert their own models; memplan must take them as given


def bfloat16_factory() -> nn.Module:
    return _small_mlp().to(torch.bfloat16)


def cuda_factory() -> nn.Module:
    return _small_mlp().cuda()


def flat_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, FEATURES)


def float_mean_square_loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def half_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, FEATURES).half()


def bfloat16_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, FEATURES).to(torch.bfloat16)


def wider_for_large_batches() -> nn.Module:
    return WiderForLargeBatches()


def batch_norm_mlp() -> nn.Module:
    """BatchNorm1d in training needs more than one value per channel: it runs at batch 2, not at 1."""
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.BatchNorm1d(FEATURES), nn.ReLU(), nn.Linear(FEATURES, 4))


class SquaredLinear(nn.Module):
    """One bias-free 256×256 Linear whose mean square is the loss: at batch 1 its optimizer step is
    the peak (AdamW's temporaries beside the state), the case where the gradients' lifetime shows."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256, bias=False)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.linear(x).pow(2).mean()}


def squared_linear() -> nn.Module:
    return SquaredLinear()


class SquaredLinears(nn.Module):
    """Three bias-free 256×256 Linear layers whose output's mean square is the loss: for-loop Adam(W)'s step is
    the peak at batch 4, with the previous parameter's `denom` (256 KiB) still held in a local."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.layers(x).square().mean()}


def squared_linears() -> nn.Module:
    return SquaredLinears()


def named_features(batch_size: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch_size, 256)}


def tied_lm_on_meta() -> nn.Module:
    """tied_lm built on torch.device("meta"): no memory, no values, as large models are built before loading."""
    with torch.device("meta"):
        return TiedLM()


class SmallGAN(nn.Module):
    """A generator and a discriminator, for steps that train both (`--step`), each with an optimizer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))


def small_gan() -> nn.Module:
    return SmallGAN()


def real_and_noise(batch_size: int) -> dict[str, torch.Tensor]:
    return {"real": torch.randn(batch_size, FEATURES), "noise": torch.randn(batch_size, 16)}
