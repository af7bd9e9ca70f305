"""LoRA models built by hand with peft, as a user's own factory would (tests/test_finetune_lora.py)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from tests.zoo import TINY_HF_CONFIGS

SEQ_LEN = 64


def _peft_causal_lm(name: str) -> nn.Module:
    config = AutoConfig.for_model(**TINY_HF_CONFIGS[name], use_cache=False)  # training: no key/value cache
    model = AutoModelForCausalLM.from_config(config)
    return get_peft_model(model, LoraConfig(r=4, lora_dropout=0.1))  # peft's default target modules


def peft_gpt2() -> nn.Module:
    return _peft_causal_lm("gpt2")


def peft_llama() -> nn.Module:
    return _peft_causal_lm("llama")


def tokens(batch_size: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, TINY_HF_CONFIGS["gpt2"]["vocab_size"], (batch_size, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def peft_bert_classifier() -> nn.Module:
    """peft's recipe for a classifier: task_type="SEQ_CLS" trains the new head (modules_to_save) beside the adapters."""
    from transformers import AutoModelForSequenceClassification

    config = AutoConfig.for_model(**{**TINY_HF_CONFIGS["bert"], "architectures": None}, num_labels=2)
    model = AutoModelForSequenceClassification.from_config(config)
    return get_peft_model(model, LoraConfig(r=4, task_type="SEQ_CLS"))


def classified_tokens(batch_size: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, TINY_HF_CONFIGS["bert"]["vocab_size"], (batch_size, SEQ_LEN))
    return {"input_ids": input_ids, "labels": torch.randint(0, 2, (batch_size,))}


def peft_loha_llama() -> nn.Module:
    """peft's LoHa adapters: their forward draws `torch.rand(1) > module_dropout` to decide whether to run."""
    from peft import LoHaConfig

    config = AutoConfig.for_model(**TINY_HF_CONFIGS["llama"], use_cache=False)
    return get_peft_model(AutoModelForCausalLM.from_config(config), LoHaConfig(r=4, target_modules=["q_proj"]))


def peft_prompt_tuning_llama() -> nn.Module:
    """peft's prompt tuning: 8 trained virtual tokens before the input, whose ids the PeftModel keeps in a plain
    attribute, `prompt_tokens = {"default": torch.arange(8)}`, neither a parameter nor a buffer."""
    from peft import PromptTuningConfig

    config = AutoConfig.for_model(**TINY_HF_CONFIGS["llama"], use_cache=False)
    return get_peft_model(
        AutoModelForCausalLM.from_config(config), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8)
    )
