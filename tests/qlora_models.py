"""QLoRA models built the way users build them, for tests/test_finetune_quantize.py: random weights
saved with save_pretrained, loaded by transformers with a BitsAndBytesConfig (bitsandbytes' CPU
backend quantizes them), prepared with peft's prepare_model_for_kbit_training and given LoRA
adapters with get_peft_model. Nothing of memplan's is used to build them."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

SEQ_LEN = 16
CONFIGS = {
    "qwen2": {  # biases on q/k/v: Linear4bit casts them to the compute dtype at its first call
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    "gpt2": {  # Conv1D layers, and an LM head tied to the embedding
        "model_type": "gpt2",
        "n_embd": 128,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "vocab_size": 512,
    },
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def saved(name: str, dtype: str) -> str:
    """A folder with the config and random weights in `dtype` (made once per process)."""
    folder = os.path.join(tempfile.gettempdir(), f"memplan-qlora-{name}-{dtype}-{os.getpid()}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # one folder per test process, gone with it
        torch.manual_seed(0)
        config = AutoConfig.for_model(**CONFIGS[name])
        AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).save_pretrained(folder)
    return folder


def user_qlora(name: str, dtype: str, bits: int = 4) -> torch.nn.Module:
    if bits == 8:  # LLM.int8() with transformers' defaults (threshold 6.0, no fp16 weights)
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=DTYPES[dtype],
        )
    model = AutoModelForCausalLM.from_pretrained(
        saved(name, dtype), quantization_config=quantization, dtype=DTYPES[dtype], device_map="cpu"
    )
    model.config.use_cache = False  # training keeps no KV cache (the QLoRA scripts set this; memplan too)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(r=4))


def qwen2_bf16() -> torch.nn.Module:
    return user_qlora("qwen2", "bf16")


def gpt2_fp16() -> torch.nn.Module:
    return user_qlora("gpt2", "fp16")


def qwen2_bf16_int8() -> torch.nn.Module:
    return user_qlora("qwen2", "bf16", bits=8)


def gpt2_fp16_int8() -> torch.nn.Module:
    return user_qlora("gpt2", "fp16", bits=8)


def tokens(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 500, (batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids}
