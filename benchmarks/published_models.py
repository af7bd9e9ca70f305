"""Models as the sources' scripts train them, for the rows of published.json that trace them.

The rasbt-vit-* and rasbt-vitft-* rows:

rasbt/pytorch-memory-optim (01_pytorch-vit.py .. 06_sgd-with-scheduler.py), rasbt/cvpr2023
(01_pytorch-vit.py, 04_fabric-vit-mixed-precision.py) and rasbt/ViT-finetuning-scripts
(precision-benchmarks/torchvision-vit16-{large,small}/01_pytorch-fp32.py .. 06_bf16-full.py) fine-tune
`torchvision.models.vit_l_16` / `vit_b_16` on CIFAR-10 resized to 224x224:

    model = vit_l_16(weights=ViT_L_16_Weights.IMAGENET1K_V1)
    model.heads.head = torch.nn.Linear(in_features=1024, out_features=10)   # 768 for vit_b_16
    ...
    logits = model(features)
    loss = F.cross_entropy(logits, targets)

The pretrained weights change no shape, so the factories build the models without them (nothing is
downloaded).

The gpumemnet-* rows: itu-rad/GPUMemNet's Test_Pipeline/cnn_models/{vgg,resnet50,mobilenet,
efficientNet,inception}.py train torchvision's models from scratch on ImageNet (1,000 classes) with
nn.CrossEntropyLoss: `models.vgg16(pretrained=False)`, `models.resnet50(pretrained=False)`,
`models.mobilenet_v2(weights=None)`, `models.efficientnet_b0(...)`, `models.inception_v3(
aux_logits=False)` on 299x299 crops (the others 224x224).

Those rows need torchvision, which only these benchmarks use (memplan does not depend on it); it is
imported when one of their factories runs (TORCHVISION_FACTORIES names them).

The llmfs-* rows: rasbt/LLMs-from-scratch ch05/10_llm-training-speed trains the book's own GPT-2-sized
GPTModel (plain PyTorch, no torchvision) in 00_orig.py, and in the steps its README lists one after the
other, whose end state is 01_opt_single_gpu.py; the llmfs_* factories below rebuild those models.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


def _torchvision_models() -> ModuleType:
    """torchvision.models, imported when a torchvision row's factory runs (published.py checks first and
    says so in one line)."""
    try:
        from torchvision import models
    except ImportError as error:
        raise ImportError("these rows need torchvision: pip install torchvision") from error
    return models


# The factories below that build torchvision's models (published.py checks torchvision for their rows).
TORCHVISION_FACTORIES = frozenset(
    {
        "rasbt_vit_l_16",
        "rasbt_vit_b_16",
        "gpumemnet_vgg16",
        "gpumemnet_resnet50",
        "gpumemnet_mobilenet_v2",
        "gpumemnet_efficientnet_b0",
        "gpumemnet_inception_v3",
    }
)


IMAGE_SIZE = 224
NUM_CLASSES = 10


class FabricStyle(nn.Module):
    """What Lightning Fabric's `_FabricModule` does around the forward of the scripts that use it
    (lightning/fabric/wrappers.py with the precision plugins of plugins/precision/{half,amp}.py):
    the floating-point input cast to the precision's dtype (`convert_input`: bfloat16 for
    "bf16-true" and "bf16-mixed", float16 for "16-mixed"), the output cast back to float32
    (`convert_output`). The float32 batch the data loader delivered stays alive beside the cast
    copy. For float32 runs (the plain-PyTorch scripts) both casts are no-ops.

    memplan gives "bf16-true" as --precision bf16 (the parameters cast) and "*-mixed" as
    --precision amp-* (autocast); the dtype is read from those: the parameters' dtype, else
    autocast's where it is on."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        dtype = next(self.module.parameters()).dtype
        device = images.device.type
        if dtype == torch.float32 and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        return self.module(images.to(dtype)).float()


def _with_cifar10_head(model: nn.Module, width: int) -> nn.Module:
    model.heads.head = nn.Linear(in_features=width, out_features=NUM_CLASSES)  # "replace output layer"
    return FabricStyle(model)


def rasbt_vit_l_16() -> nn.Module:
    """torchvision's vit_l_16 (24 layers, width 1024, 16 heads, MLP 4096) with a 10-class head."""
    return _with_cifar10_head(_torchvision_models().vit_l_16(), 1024)


def rasbt_vit_b_16() -> nn.Module:
    """torchvision's vit_b_16 (12 layers, width 768, 12 heads, MLP 3072) with a 10-class head."""
    return _with_cifar10_head(_torchvision_models().vit_b_16(), 768)


def cifar10_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the scripts' loaders give it: float32 images (ToTensor after Resize((224, 224)))
    and int64 class labels."""
    images = torch.rand(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,))
    return images, labels


def cross_entropy(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`F.cross_entropy(logits, targets)`, as every script computes its loss."""
    return F.cross_entropy(logits, batch[1])


IMAGENET_CLASSES = 1000


class ImagesOnly(nn.Module):
    """`outputs = model(images)`: the batch memplan passes is (images, labels), the loss takes the labels."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.module(images)


def gpumemnet_vgg16() -> nn.Module:
    return ImagesOnly(_torchvision_models().vgg16(weights=None))


def gpumemnet_resnet50() -> nn.Module:
    return ImagesOnly(_torchvision_models().resnet50(weights=None))


def gpumemnet_mobilenet_v2() -> nn.Module:
    return ImagesOnly(_torchvision_models().mobilenet_v2(weights=None))


def gpumemnet_efficientnet_b0() -> nn.Module:
    return ImagesOnly(_torchvision_models().efficientnet_b0(weights=None))


def gpumemnet_inception_v3() -> nn.Module:
    """aux_logits=False as the script builds it; init_weights=False only skips torchvision's scipy-based
    initialisation, which changes no shape."""
    return ImagesOnly(_torchvision_models().inception_v3(weights=None, aux_logits=False, init_weights=False))


def _imagenet_batch(batch_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.rand(batch_size, 3, size, size)
    labels = torch.randint(0, IMAGENET_CLASSES, (batch_size,))
    return images, labels


def imagenet_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 224x224 crops (Resize(256) + CenterCrop(224)) with int64 labels."""
    return _imagenet_batch(batch_size, 224)


def imagenet_batch_299(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inception's 299x299 crops."""
    return _imagenet_batch(batch_size, 299)


# The llmfs-* rows: rasbt/LLMs-from-scratch ch05/10_llm-training-speed at 908dd2f (2025-02-12), the commit
# that added the README's figures with 00_orig.py and 01_opt_single_gpu.py (later commits there change
# neither the figures nor the models). The classes follow 00_orig.py op for op (the order of the
# projections, the in-place masked_fill_, the from-scratch LayerNorm and GELU), with the
# `GPT_CONFIG_124M` of both scripts before 01_opt_single_gpu.py's vocabulary padding (step 9).

GPT_124M = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12}
DROP_RATE = 0.1


class ScratchLayerNorm(nn.Module):
    """00_orig.py's `LayerNorm` (the book's chapter 4): mean and biased variance, then scale and shift."""

    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class ScratchGELU(nn.Module):
    """00_orig.py's `GELU`: the tanh approximation written out, its constant a 0-dim float32 tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))


class ScratchMultiHeadAttention(nn.Module):
    """00_orig.py's `MultiHeadAttention`: three bias-free projections, eager attention with a causal mask
    filled in place, dropout on the attention weights.

    `mask_buffer=True` is 00_orig.py: a float32 triu(ones(context, context)) buffer per layer, converted
    with `.bool()` in every forward. `False` is the README's step 1 ("Create causal mask on the fly"),
    whose code was not published: the mask is built as the repository's later models build it
    (pkg/llms_from_scratch/llama3.py, qwen3.py), a bool triu of the sequence length, an assumption that
    moves at most one (seq, seq) float32 temporary (4 MiB at 1024 tokens) in the forward."""

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int, mask_buffer: bool
    ) -> None:
        super().__init__()
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.mask_buffer = mask_buffer
        if mask_buffer:
            self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, num_tokens, _ = x.shape
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        if self.mask_buffer:
            mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        else:
            mask_bool = torch.triu(torch.ones(num_tokens, num_tokens, device=x.device, dtype=torch.bool), diagonal=1)
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


class SDPAMultiHeadAttention(nn.Module):
    """01_opt_single_gpu.py's `PyTorchMultiHeadAttention` (the README's step 7, "Using FlashAttention"):
    one fused bias-free qkv projection and `F.scaled_dot_product_attention(is_causal=True)` with the
    dropout rate while training."""

    def __init__(self, d_in: int, d_out: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.d_out = d_out
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=False)
        self.proj = nn.Linear(d_out, d_out)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, num_tokens, _ = x.shape
        qkv = self.qkv(x).view(batch_size, num_tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        queries, keys, values = qkv
        use_dropout = self.dropout if self.training else 0.0
        context_vec = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=None, dropout_p=use_dropout, is_causal=True
        )
        context_vec = context_vec.transpose(1, 2).contiguous().view(batch_size, num_tokens, self.d_out)
        return self.proj(context_vec)


class TransformerBlock(nn.Module):
    """00_orig.py's `TransformerBlock`: pre-norm attention and feed-forward (Linear, GELU, Linear at 4x
    width), each followed by dropout and its shortcut. `native=True` is the README's step 6: nn.LayerNorm
    and nn.GELU(approximate="tanh") as in 01_opt_single_gpu.py."""

    def __init__(self, attention: nn.Module, native: bool) -> None:
        super().__init__()
        emb_dim = GPT_124M["emb_dim"]
        self.att = attention
        self.ff = nn.Sequential(
            nn.Linear(emb_dim, 4 * emb_dim),
            nn.GELU(approximate="tanh") if native else ScratchGELU(),
            nn.Linear(4 * emb_dim, emb_dim),
        )
        self.norm1 = nn.LayerNorm(emb_dim) if native else ScratchLayerNorm(emb_dim)
        self.norm2 = nn.LayerNorm(emb_dim) if native else ScratchLayerNorm(emb_dim)
        self.drop_shortcut = nn.Dropout(DROP_RATE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.drop_shortcut(self.att(self.norm1(x)))
        x = x + shortcut
        shortcut = x
        x = self.drop_shortcut(self.ff(self.norm2(x)))
        return x + shortcut


class GPTModel(nn.Module):
    """00_orig.py's `GPTModel`: token and position embeddings, embedding dropout, 12 blocks, a final norm
    and an untied, bias-free output head (163M parameters). `forward(in_idx, target_ids)` takes the
    batch the loader gives and, as the script's `calc_loss_batch` does, feeds the model the inputs only."""

    def __init__(self, attention: str, native: bool) -> None:
        super().__init__()
        config = GPT_124M
        emb_dim, heads = config["emb_dim"], config["n_heads"]
        self.tok_emb = nn.Embedding(config["vocab_size"], emb_dim)
        self.pos_emb = nn.Embedding(config["context_length"], emb_dim)
        self.drop_emb = nn.Dropout(DROP_RATE)

        def attention_layer() -> nn.Module:
            if attention == "sdpa":
                return SDPAMultiHeadAttention(emb_dim, emb_dim, heads, DROP_RATE)
            mask_buffer = attention == "mask-buffer"
            return ScratchMultiHeadAttention(emb_dim, emb_dim, config["context_length"], DROP_RATE, heads, mask_buffer)

        self.trf_blocks = nn.Sequential(
            *[TransformerBlock(attention_layer(), native) for _ in range(config["n_layers"])]
        )
        self.final_norm = nn.LayerNorm(emb_dim) if native else ScratchLayerNorm(emb_dim)
        self.out_head = nn.Linear(emb_dim, config["vocab_size"], bias=False)

    def forward(self, in_idx: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        seq_len = in_idx.shape[1]
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(seq_len, device=in_idx.device))
        x = self.trf_blocks(self.drop_emb(x))
        return self.out_head(self.final_norm(x))


def llmfs_gpt124m_orig() -> nn.Module:
    """00_orig.py as published: from-scratch LayerNorm and GELU, eager attention with the registered mask."""
    return GPTModel("mask-buffer", native=False)


def llmfs_gpt124m_mask_on_the_fly() -> nn.Module:
    """Step 1: 00_orig.py with the causal mask built in each forward instead of registered."""
    return GPTModel("mask-on-the-fly", native=False)


def llmfs_gpt124m_native_norm_gelu() -> nn.Module:
    """Step 6: step 1's attention with nn.LayerNorm and nn.GELU(approximate="tanh")."""
    return GPTModel("mask-on-the-fly", native=True)


def llmfs_gpt124m_sdpa() -> nn.Module:
    """Step 7: 01_opt_single_gpu.py's model (vocabulary 50,257, before step 9 pads it)."""
    return GPTModel("sdpa", native=True)


def llmfs_tokens_1024(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, target_ids) as `GPTDatasetV1` gives them with max_length = stride = 1024: int64 token
    ids, the targets shifted by one."""
    ids = torch.randint(0, GPT_124M["vocab_size"], (batch_size, GPT_124M["context_length"] + 1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def llmfs_cross_entropy(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`calc_loss_batch`: torch.nn.functional.cross_entropy(logits.flatten(0, 1), target_batch.flatten())."""
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
