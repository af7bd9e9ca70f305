"""4-bit and 8-bit base weights for QLoRA, laid out and run by bitsandbytes itself
(`--quantize nf4|fp4|int8`).

8 bits (`int8`) is `BitsAndBytesConfig(load_in_8bit=True)`: the same layers become
`bnb.nn.Linear8bitLt` (threshold 6.0, no fp16 weights) holding LLM.int8()'s layout (`_load_int8`);
peft wraps them in its `lora.bnb.Linear8bitLt` (`is_loaded_in_8bit`). How its matmul runs on each
device is memplan.finetune.bnb_kernels. The rest of this docstring is the 4-bit recipe, which 8 bits
shares but for the layout and the bias (below).

What a QLoRA run builds, and where memplan takes it from:
- Which layers: transformers' own bitsandbytes quantizer prepares the built model, as
  `from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))` does
  (`preprocess_model`, which runs `replace_with_bnb_linear`): every
  `nn.Linear` (exactly that type) and GPT-2 `Conv1D` becomes a `bnb.nn.Linear4bit`, except what
  `get_modules_to_not_convert` keeps (the output embedding, tied weights, the last layer, the
  model's `_keep_in_fp32_modules`), with
  the options of the QLoRA recipe (Dettmers et al. 2023; the bnb-4bit-training notebook):
  `bnb_4bit_use_double_quant=True`, `bnb_4bit_compute_dtype` the precision's 16-bit dtype (float32
  for fp32), blocksize 64, uint8 storage. The weight is quantized in that dtype, as a model loaded
  with `torch_dtype=` it is.
- The layout is bitsandbytes' own: `bitsandbytes.functional.quantize_4bit` runs on the fake weight
  (its ops have fake implementations, bitsandbytes/_ops.py), giving the packed weight
  ((N*K+1)//2 bytes) and the QuantState: per 64-weight block one uint8 absmax (double-quantized),
  per 256 of those one float32, the float32 offset, and a 16-entry and a 256-entry float32 code
  table per layer (`code.to(device, copy=True)`). The QuantState's tensors are kept as
  non-persistent buffers of the layer, so they count with the model.
- The forward and backward are bitsandbytes' (`Linear4bit.forward`, `MatMul4Bit`); the backward
  dequantizes the whole weight to the compute dtype for the input gradient. What the `gemm_4bit`
  kernel allocates inside is a per-op rule (memplan.finetune.bnb_kernels).
- peft's `prepare_model_for_kbit_training` (which trl's SFTTrainer calls for quantized models, and
  peft's QLoRA guide) casts every parameter left in 16 bits (embeddings, norms, the LM head) to
  float32; `--no-kbit-upcast` leaves them in the dtype the model was loaded in, the compute dtype
  (under amp-bf16 the embeddings and norms stay bfloat16, as `torch_dtype=torch.bfloat16` loads
  them). It also freezes them, which `--lora` does anyway; its gradient checkpointing is
  `--checkpoint`'s to choose.
- peft wraps `Linear4bit` in its own `lora.bnb.Linear4bit` where the model says it is loaded in 4 bit
  (`is_loaded_in_4bit`), which adds a `result.clone()` to every adapted layer.

bitsandbytes is an optional dependency (`pip install 'memplan[qlora]'`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan.errors import SettingsError, UsageError
from memplan.estimator.fake_conversions import cast_floating_point
from memplan.finetune.quiet import bitsandbytes_quiet
from memplan.settings import TrainingSettings

# BitsAndBytesConfig's bnb_4bit_blocksize default and Params4bit's (bitsandbytes/nn/modules.py).
BLOCK_SIZE = 64
INT8 = "int8"  # LLM.int8(): BitsAndBytesConfig(load_in_8bit=True), bnb.nn.Linear8bitLt
# Buffers memplan registers so that a quantized layer's constants count with the model, where
# bitsandbytes keeps them as attributes (the QuantState, MatmulLtState.SCB): no real buffers.
QUANT_STATE_BUFFER_PREFIX = "quant_state_"
INT8_SCALES_BUFFER = "int8_row_scales"
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "amp-bf16": torch.bfloat16, "fp16": torch.float16, "amp-fp16": torch.float16}


def _import_bitsandbytes():  # type: ignore[no-untyped-def]
    try:
        with bitsandbytes_quiet():
            import bitsandbytes
            import bitsandbytes.functional
    except ImportError:
        raise UsageError(
            "--quantize lays the base weights out with bitsandbytes, which is not installed: "
            "pip install 'memplan[qlora]'"
        ) from None
    return bitsandbytes


def compute_dtype(settings: TrainingSettings) -> torch.dtype:
    """bnb_4bit_compute_dtype as the QLoRA recipe sets it for the precision: its 16-bit dtype."""
    return COMPUTE_DTYPES.get(settings.precision, torch.float32)


def _load_quantized(bnb, layer: nn.Module, source: nn.Module, settings: TrainingSettings) -> None:  # type: ignore[no-untyped-def]
    """Give `layer`, a bitsandbytes layer transformers made on the meta device, `source`'s weight
    quantized by bitsandbytes itself (as loading a checkpoint into it does) and `source`'s bias."""
    from transformers.pytorch_utils import Conv1D

    weight = source.weight.detach()
    if isinstance(source, Conv1D):  # GPT-2 keeps (in, out); transformers transposes before quantizing
        weight = weight.t()
    weight = weight.to(compute_dtype(settings)).contiguous()
    if settings.quantize == INT8:
        _load_int8(bnb, layer, weight)
    else:
        _load_4bit(bnb, layer, weight, settings.quantize)
    layer._parameters["bias"] = source.bias


def _load_4bit(bnb, layer: nn.Module, weight: torch.Tensor, quant_type: str) -> None:  # type: ignore[no-untyped-def]
    packed, quant_state = bnb.functional.quantize_4bit(
        weight,
        blocksize=BLOCK_SIZE,
        compress_statistics=True,
        quant_type=quant_type,
        quant_storage=torch.uint8,
    )
    # A Params4bit over a fake tensor cannot be made (Tensor._make_subclass refuses it); a fake
    # tensor marked as a parameter, carrying the attributes bitsandbytes and peft read, stands in.
    weight_param = nn.Parameter(packed, requires_grad=False)
    weight_param.quant_state = quant_state
    weight_param.compress_statistics = True
    weight_param.quant_type = quant_type
    weight_param.blocksize = BLOCK_SIZE
    weight_param.quant_storage = torch.uint8
    weight_param.bnb_quantized = True
    weight_param.module = layer
    layer._parameters["weight"] = weight_param
    for name, tensor in _quant_state_tensors(quant_state):
        layer.register_buffer(f"{QUANT_STATE_BUFFER_PREFIX}{name}", tensor, persistent=False)


def _load_int8(bnb, layer: nn.Module, weight: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """LLM.int8()'s layout, as Int8Params._quantize makes it when the model moves to its device: the
    weight cast to float16, then `int8_vectorwise_quant` gives the int8 weight CB (N x K) and one
    float32 scale per output row, SCB (N)."""
    int8_weight, row_scales, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
    # As for 4 bits, a fake parameter carrying Int8Params' attributes stands in for one. The first
    # forward moves CB and SCB into the layer's MatmulLtState (init_8bit_state), where only the layer
    # holds SCB: it is kept as a buffer too, so it counts with the model.
    weight_param = nn.Parameter(int8_weight, requires_grad=False)
    weight_param.CB = int8_weight
    weight_param.SCB = row_scales
    weight_param.has_fp16_weights = False
    layer._parameters["weight"] = weight_param
    layer.register_buffer(INT8_SCALES_BUFFER, row_scales, persistent=False)


def _quant_state_tensors(quant_state) -> list[tuple[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    tensors = [("absmax", quant_state.absmax), ("code", quant_state.code)]
    if quant_state.nested:
        tensors += [
            ("offset", quant_state.offset),
            ("absmax2", quant_state.state2.absmax),
            ("code2", quant_state.state2.code),
        ]
    return tensors


@contextlib.contextmanager
def _bitsandbytes_caches_kept() -> Iterator[None]:
    """quantize_blockwise caches its code table in bitsandbytes' module-level `name2qmap` the first
    time it runs: made under fake tensors, that would be a fake tensor every later real
    quantization in the process used. The caches are put back as they were."""
    from bitsandbytes import functional

    saved = dict(functional.name2qmap)
    try:
        yield
    finally:
        functional.name2qmap.clear()
        functional.name2qmap.update(saved)


def bookkeeping_buffers(model: nn.Module) -> list[str]:
    """The qualified names of the buffers memplan registered on quantized layers (not real buffers:
    a DDP wrapper must not broadcast them)."""
    return [
        name
        for name, _ in model.named_buffers()
        if name.rsplit(".", 1)[-1].startswith(QUANT_STATE_BUFFER_PREFIX) or name.endswith(f".{INT8_SCALES_BUFFER}")
    ]


def logical_numel(param: torch.Tensor) -> int:
    """The weights a parameter stands for: a 4-bit layer's packed bytes hold two each."""
    quant_state = getattr(param, "quant_state", None)
    return int(torch.Size(quant_state.shape).numel()) if quant_state is not None else param.numel()


def _bitsandbytes_config(settings: TrainingSettings):  # type: ignore[no-untyped-def]
    from transformers import BitsAndBytesConfig

    if settings.quantize == INT8:
        # transformers' defaults, which the 8-bit LoRA recipes keep: llm_int8_threshold=6.0 (outlier
        # columns in 16 bits) and llm_int8_has_fp16_weight=False (the int8 weight only).
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=settings.quantize,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype(settings),
    )


def quantized(model: nn.Module, settings: TrainingSettings) -> nn.Module:
    """`model` with its linear layers in bitsandbytes' 4-bit or 8-bit layout where `settings.quantize`
    asks, chosen and replaced by transformers' own bitsandbytes quantizer (`preprocess_model`), which
    keeps what `get_modules_to_not_convert` names (the output embedding, tied weights, the last
    layer, `_keep_in_fp32_modules`)."""
    if settings.quantize is None:
        return model
    bnb = _import_bitsandbytes()
    from transformers import PreTrainedModel
    from transformers.quantizers.auto import AutoHfQuantizer

    if not isinstance(model, PreTrainedModel):
        raise SettingsError(
            f"--quantize quantizes a transformers model as from_pretrained(quantization_config=...) does; "
            f"{type(model).__name__} is not one: quantize it in your factory, or leave out --quantize"
        )
    layer_type = bnb.nn.Linear8bitLt if settings.quantize == INT8 else bnb.nn.Linear4bit
    sources = dict(model.named_modules())
    with unset_fake_temporarily():  # the new layers are made on the meta device: no float weights
        AutoHfQuantizer.from_config(_bitsandbytes_config(settings)).preprocess_model(model, device_map=None)
    with _bitsandbytes_caches_kept():
        for name, layer in model.named_modules():
            if isinstance(layer, layer_type) and sources.get(name) is not layer:
                _load_quantized(bnb, layer, sources[name], settings)
    # What peft reads to wrap the layer in its own bnb LoRA layer.
    if settings.quantize == INT8:
        model.is_loaded_in_8bit = True
    else:
        model.is_loaded_in_4bit = True
    for param in model.parameters():
        param.requires_grad_(False)
    # A quantized model is loaded in the compute dtype (`torch_dtype=`), its 4-bit layers quantized
    # from it; prepare_model_for_kbit_training then casts what is left to float32.
    # What is left unquantized (parameters, not buffers) in that dtype, frozen, as peft casts it.
    unquantized_dtype = torch.float32 if settings.kbit_upcast else compute_dtype(settings)
    cast_floating_point(model, unquantized_dtype, buffers=False, frozen=True)
    # Linear4bit.forward casts its bias to the compute dtype in place at the first call
    # (`bias.data = bias.data.to(x.dtype)`): from then on, the steady state, it is held so.
    # (Linear8bitLt casts it to its input's dtype, which only the forward knows: it is left as loaded,
    # which matches the input's dtype in every precision memplan builds.)
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear4bit) and layer.bias is not None:
            layer._parameters["bias"] = nn.Parameter(layer.bias.detach().to(layer.compute_dtype), requires_grad=False)
    return model
