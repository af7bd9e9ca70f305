"""LoRA adapters added with peft, as `get_peft_model(model, LoraConfig(...))` adds them.

peft is an optional dependency (`pip install 'memplan[peft]'`): memplan builds the adapters with
the library users train with rather than a copy of it, so the layers it targets by default per
architecture (peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), the adapters' shapes and
their dtype (peft keeps 16-bit models' adapters in float32: `autocast_adapter_dtype`) are peft's.
The base model's parameters stop requiring gradients, so they get neither gradients nor optimizer
state; the adapters get both.
"""

from __future__ import annotations

import warnings

from torch import nn

from memplan.errors import SettingsError, UsageError
from memplan.finetune.quiet import bitsandbytes_quiet
from memplan.settings import TrainingSettings


def _import_peft():  # type: ignore[no-untyped-def]
    """peft's LoraConfig and get_peft_model (peft imports bitsandbytes where it is installed)."""
    try:
        with bitsandbytes_quiet():
            from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UsageError(
            "--lora builds the adapters with peft, which is not installed: pip install 'memplan[peft]'"
        ) from None
    return LoraConfig, get_peft_model


def adapter_parameters(model: nn.Module) -> frozenset[int]:
    """The ids of the adapter parameters of peft's tuner layers in `model` (a model the user wrapped with
    get_peft_model before giving it to memplan): they keep the dtype the user gave them when memplan casts the
    model to a 16-bit precision, as peft keeps a 16-bit model's adapters in float32 (`autocast_adapter_dtype`).
    Empty, without importing peft, where no module comes from it."""
    if not any(type(module).__module__.startswith("peft.") for module in model.modules()):
        return frozenset()
    from peft.tuners.tuners_utils import BaseTunerLayer

    kept: set[int] = set()
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for name in module.adapter_layer_names:  # ("lora_A", "lora_B", ...): dicts of adapters by name
                adapters = getattr(module, name, None)
                if isinstance(adapters, nn.Module):
                    kept.update(id(param) for param in adapters.parameters())
    return frozenset(kept)


def with_lora(model: nn.Module, settings: TrainingSettings) -> nn.Module:
    """`model` with LoRA adapters where `settings.lora_rank` asks for them, else `model` itself."""
    if settings.lora_rank is None:
        return model
    if adapter_parameters(model):
        # peft would replace the user's adapters or add a second set beside them, and warn about it
        raise SettingsError(
            "this model has LoRA adapters already (it is a peft model): leave out --lora, or give memplan the "
            "model before get_peft_model"
        )
    LoraConfig, get_peft_model = _import_peft()  # noqa: N806 (peft's class, under its own name)
    options: dict[str, object] = {"r": settings.lora_rank, "lora_dropout": settings.lora_dropout}
    if settings.lora_alpha is not None:
        options["lora_alpha"] = settings.lora_alpha
    if type(model).__name__.endswith("ForSequenceClassification"):
        # peft's recipe for a classifier (task_type="SEQ_CLS"): its new head ("classifier", "score") is trained too,
        # as a copy peft keeps beside the frozen original (ModulesToSaveWrapper); without it the head stayed frozen
        # and its gradient and optimizer state were missing (a helper's bug hunt).
        options["task_type"] = "SEQ_CLS"
    if settings.lora_targets is not None:
        names = [name.strip() for name in settings.lora_targets.split(",")]  # none empty (settings)
        # peft's shorthand for every linear layer but the output head is a string, not a module's name
        options["target_modules"] = ALL_LINEAR if names == [ALL_LINEAR] else names
    with warnings.catch_warnings():
        # peft says it switched fan_in_fan_out on for GPT-2's Conv1D layers (it handles them itself),
        # and asks transformers a question transformers 5 calls by a new name: neither is the user's.
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        try:
            return get_peft_model(model, LoraConfig(**options))
        except ValueError as error:
            # peft's message runs over several lines (the module it could not adapt, printed whole): one line
            reason = " ".join(str(error).split()) or type(error).__name__
            if len(reason) > 300:
                reason = reason[:297] + "..."
            layers = _linear_layer_names(model)
            example = ",".join(layers[:2]) if layers else "q_proj,v_proj"
            listed = f" (this model's linear layers: {', '.join(layers)})" if layers else ""
            raise SettingsError(
                f"peft cannot add LoRA adapters to this model ({reason}); name the layers to adapt with "
                f"--lora-targets, e.g. --lora-targets {example}{listed}, or {ALL_LINEAR}"
            ) from None


ALL_LINEAR = "all-linear"  # peft's INCLUDE_LINEAR_LAYERS_SHORTHAND


def _linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct names of the model's linear layers (nn.Linear, transformers' Conv1D), in model order: what
    --lora-targets can name."""
    names = [
        _target_name(name)
        for name, module in model.named_modules()
        if name and (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")
    ]
    return list(dict.fromkeys(names))


def _target_name(name: str) -> str:
    """A layer's name as peft matches --lora-targets (a suffix of the dotted name): the last part, or the last two
    where the last is an index in a Sequential (`classifier.1`: `1` alone would match every block numbered 1)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
