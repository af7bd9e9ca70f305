"""Hugging Face models from presets, model types, config files or the local hub cache."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from memplan.models.batches import TASKS
from memplan.models.presets import get_preset, preset_for_hub_id
from memplan.models.text_heads import ARCHITECTURE_SUFFIXES, AUTO_CLASSES, MAPPINGS

# Which transformers auto class builds each task head.
_AUTO_CLASS_BY_TASK = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
    "semantic-segmentation": "AutoModelForSemanticSegmentation",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "ctc": "AutoModelForCTC",
    "audio-classification": "AutoModelForAudioClassification",
    "zero-shot-image-classification": "AutoModelForZeroShotImageClassification",
    **AUTO_CLASSES,  # token-classification, question-answering, multiple-choice (memplan.models.text_heads)
    "image-text-to-text": "AutoModelForImageTextToText",
}
# Mapping names in transformers.models.auto.modeling_auto, in the order a task is guessed.
_MAPPING_BY_TASK = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "zero-shot-image-classification": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "semantic-segmentation": "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    **MAPPINGS,  # last: a config naming no head is guessed one of the tasks above
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",  # (after them too)
}
_ARCHITECTURE_SUFFIXES = {
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
    "ForConditionalGeneration": "seq2seq",
    "ForMaskedLM": "masked-lm",
    "ForPreTraining": "masked-lm",
    "ForImageClassification": "image-classification",
    "ForSemanticSegmentation": "semantic-segmentation",
    "ForSequenceClassification": "sequence-classification",
    "ForSpeechToText": "speech-seq2seq",
    "ForCTC": "ctc",
    "ForAudioClassification": "audio-classification",
    **ARCHITECTURE_SUFFIXES,
}


@dataclass(frozen=True)
class HFSource:
    name: str
    config: Any
    task: str
    # Where memplan chose the head itself (no --task, no preset, no architecture in the config): the class it builds,
    # said in the answer's notes; None where the head was named.
    guessed_class: str | None = None
    # Where the config's architecture chose the task and transformers lists that class under other tasks too
    # (Gemma3ForConditionalGeneration: causal-lm, trained on text, and image-text-to-text): those tasks, said in the
    # notes.
    other_tasks: tuple[str, ...] = ()


def import_transformers_models() -> None:
    """Import transformers.models without scanning transformers' model folders a second time.

    `import transformers` reads every file under transformers/models for its `__all__` (1,700 files,
    define_import_structure: about 0.5 s) to build its lazy module; importing transformers.models (what any
    config or model class needs) reads them all again: its __init__.py asks for the same folder under another
    name (its own file's path, where transformers' is `Path(...) / "models"`), and the lru_cache of the
    per-folder scans holds 128 of the 500-odd folders. Asked for by the name the first scan used, the
    folder's structure comes from that cache: the same folder, the same function, the same lazy module
    (every name in it, in the same order). Where the cache no longer holds it (another transformers), the
    scan runs again, as it would have."""
    if "transformers.models" in sys.modules:
        return
    import transformers
    from transformers.utils import import_utils

    scan = getattr(import_utils, "define_import_structure", None)
    file = getattr(transformers, "__file__", None)
    if scan is None or file is None:
        import transformers.models  # noqa: F401

        return
    folder = os.path.join(os.path.dirname(file), "models")
    from pathlib import Path

    def scan_once(module_path: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and os.path.normpath(str(module_path)) == os.path.join(folder, "__init__.py"):
            module_path = Path(folder)  # as transformers/__init__.py names it
        return scan(module_path, *args, **kwargs)  # (any other call, or signature, passed on as it came)

    import_utils.define_import_structure = scan_once  # what transformers/models/__init__.py imports, as it runs
    try:
        import transformers.models  # noqa: F401
    finally:
        import_utils.define_import_structure = scan


def model_types() -> list[str]:
    import_transformers_models()
    from transformers import CONFIG_MAPPING

    return sorted(CONFIG_MAPPING.keys())


def _classes_of(config: Any, task: str) -> tuple[str, ...]:
    """The classes transformers' auto mapping for `task` builds for the config's model type (DeiT's image
    classification maps to two, a tuple)."""
    from transformers.models.auto import modeling_auto

    classes = getattr(modeling_auto, _MAPPING_BY_TASK[task]).get(config.model_type, ())
    return (classes,) if isinstance(classes, str) else tuple(classes)


def _names_a_head(architecture: str, config: Any) -> bool:
    """Whether the architecture trains a head of its own: a `...For<Task>` class, or a two-tower model whose forward
    computes its contrastive loss (CLIPModel, SiglipModel: `return_loss=True`, over both towers)."""
    two_towers = getattr(config, "text_config", None) is not None and getattr(config, "vision_config", None) is not None
    return "For" in architecture or (two_towers and architecture.endswith("Model"))


def _architecture_task(config: Any) -> str | None:
    """The task whose auto class builds the architecture the config names (BertForPreTraining's nearest: masked-lm),
    where the model type is in that task's mapping; None where it names none of memplan's tasks."""
    for architecture in getattr(config, "architectures", None) or []:
        for task in _MAPPING_BY_TASK:
            if architecture in _classes_of(config, task):
                return task
        for suffix, task in _ARCHITECTURE_SUFFIXES.items():
            # (Whisper's WhisperForConditionalGeneration is in the speech-seq2seq mapping, found above, not seq2seq's.)
            if architecture.endswith(suffix) and _classes_of(config, task):
                return task
    return None


def _refuse_other_heads(config: Any, name: str) -> None:
    """A config naming a head memplan does not train (DPTForDepthEstimation, DETR's detection) had been built as
    another head of its model type (SegformerForSemanticSegmentation as Segformer's image classifier, CLIPModel as
    CLIP's vision tower alone, before each was a task: 42% and 38% below the named model's measured step) or failed
    saying "fix the config": refused, saying which heads memplan can estimate instead."""
    from memplan.errors import UsageError

    heads = [
        architecture
        for architecture in getattr(config, "architectures", None) or []
        if _names_a_head(architecture, config)
    ]
    if not heads:
        return
    offered = [f"{task} ({_classes_of(config, task)[0]})" for task in _MAPPING_BY_TASK if _classes_of(config, task)]
    instead = (
        f"pass --task to estimate another head of {config.model_type} instead ({', '.join(offered)}), "
        if offered
        else ""
    )
    raise UsageError(
        f"{name!r} names {heads[0]}, a head none of memplan's tasks builds ({', '.join(TASKS)}): "
        f"{instead}{'or give' if offered else 'give'} the model, its batch and loss as your own module:function "
        "(docs/usage.md, custom models)"
    )


def _other_tasks_of_architecture(config: Any, chosen: str) -> tuple[str, ...]:
    """The other tasks whose auto classes hold the architecture the config names for `chosen`; not masked-lm, where
    transformers lists a text model's generation class for its pre-training too (BART's, XLM's): the note would point
    at the same text step."""
    named = [
        architecture
        for architecture in getattr(config, "architectures", None) or []
        if architecture in _classes_of(config, chosen)
    ]
    return tuple(
        task
        for task in _MAPPING_BY_TASK
        if task not in (chosen, "masked-lm")
        and any(architecture in _classes_of(config, task) for architecture in named)
    )


def _guess_task(config: Any, name: str) -> tuple[str | None, bool]:
    """The task to train for a config that names none (no --task, no preset), and whether memplan chose it itself
    (False where the config's architectures name it)."""
    named = _architecture_task(config)
    if named is not None:
        return named, False
    _refuse_other_heads(config, name)
    mapped = [task for task in _MAPPING_BY_TASK if _classes_of(config, task)]
    if getattr(config, "is_encoder_decoder", False):
        # BART, mBART, Pegasus, Marian, Whisper are in the causal-LM mapping too, for their decoder alone
        # (BartForCausalLM, WhisperForCausalLM): an encoder-decoder config trains both halves, text to text or
        # speech to text, or cannot be told.
        return next((task for task in ("seq2seq", "speech-seq2seq") if task in mapped), None), True
    if "masked-lm" in mapped and not getattr(config, "is_decoder", False):
        # An encoder family's causal-LM class (BertLMHeadModel, RobertaForCausalLM) is its decoder use, which needs
        # is_decoder=True (transformers warns "If you want to use BertLMHeadModel as a standalone, add
        # is_decoder=True"); an encoder config (BERT, RoBERTa, ELECTRA, XLM-R: is_decoder False) pre-trains its
        # masked-LM head.
        return "masked-lm", True
    return (mapped[0] if mapped else None), True


def _load_config(name: str) -> Any | None:
    """A config from a preset, a config.json / model directory, a model type or the hub cache."""
    import_transformers_models()
    from transformers import CONFIG_MAPPING, AutoConfig

    preset = get_preset(name)
    if preset is not None:
        return AutoConfig.for_model(preset.model_type, **preset.config)
    if os.path.isdir(name) or (os.path.isfile(name) and name.endswith(".json")):
        return _local_config(name)
    if name in CONFIG_MAPPING:
        return AutoConfig.for_model(name)
    if "/" in name and not os.path.exists(name):
        try:
            return AutoConfig.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError):
            # Not in the local hub cache: the preset made from that hub id's config, offline.
            by_hub_id = preset_for_hub_id(name)
            return AutoConfig.for_model(by_hub_id.model_type, **by_hub_id.config) if by_hub_id else None
    return None


def _local_config(path: str) -> Any:
    """A config.json or a model directory's, or one line saying what is wrong with it."""
    import json

    from transformers import AutoConfig

    from memplan.errors import UsageError

    where = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(where):
        raise UsageError(f"{path!r} is a directory with no config.json: point at a model directory or its config.json")
    try:
        with open(where, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read {where} as a JSON config: {error}") from error
    if not isinstance(data, dict) or not data.get("model_type"):
        raise UsageError(
            f"{where} has no model_type: a transformers config.json names its architecture there "
            '(for example "model_type": "llama")'
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 (parsing the file: what it raises is the file's mistake)
        # huggingface_hub's StrictDataclassFieldValidationError (a field of the wrong type) says which field on its
        # first line and what is wrong on its second: both, on one
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        said = " ".join(lines[:2]) if lines else type(error).__name__
        model_type = data["model_type"]
        raise UsageError(f"transformers cannot load {where} (model_type {model_type!r}): {said}") from error
    _check_fields(data, type(config), where)
    return config


def _check_fields(data: dict[str, Any], config_class: type, where: str) -> None:
    """transformers keeps a key its config class does not know as a plain attribute and builds the model from
    its defaults: memplan's own preset file (its fields under "config") built a full-size GPT-2, and `n_layers`
    for GPT-2's `n_layer` its default 12 layers. A key that is a near miss of a field the file leaves at its
    default is refused; other unknown keys (hub files carry some of their own) are left alone."""
    import difflib
    import inspect

    from memplan.errors import UsageError

    try:
        defaults = config_class().to_dict()
    except Exception:  # a class that needs arguments to exist (nougat's, gemma4_assistant's): no defaults to miss
        return
    renames: dict[str, str] = dict(getattr(config_class, "attribute_map", {}) or {})
    known = set(defaults) | set(renames) | set(inspect.signature(config_class.__init__).parameters)
    given = {renames.get(key, key) for key in data}
    # Properties of the class are fields too: `num_labels` is PretrainedConfig's, setting id2label (a false refusal
    # of a Swin config with num_labels, close to its num_layers, in a helper's bug hunt).
    unknown = [key for key in data if key not in known and not hasattr(config_class, key) and not key.startswith("_")]
    if isinstance(data.get("config"), dict) and "config" in unknown:
        raise UsageError(
            f'{where} is a memplan preset file (its fields under "config"): give the preset\'s name, or write '
            'the fields under "config" at the top level beside model_type, as a transformers config.json has them'
        )
    left_at_default = sorted(field for field in defaults if field not in given and not field.startswith("_"))
    for key in unknown:
        meant = difflib.get_close_matches(key, left_at_default, n=1, cutoff=0.8)
        if meant:
            raise UsageError(
                f"{where}: {key!r} is not a field of transformers' {config_class.__name__}, which would build "
                f"the model with its default {meant[0]} ({defaults[meant[0]]!r}): did you mean {meant[0]!r}?"
            )


def _asserted_by_a_module(error: AssertionError) -> bool:
    """Whether the assertion is a module constructor's check of its arguments (torch.nn's modules, transformers')."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    innermost = frames[-1].filename if frames else ""
    return any(
        part in innermost
        for part in (f"{os.sep}torch{os.sep}nn{os.sep}modules{os.sep}", f"{os.sep}transformers{os.sep}")
    )


def _builds_as_seq2seq(config: Any) -> bool:
    from transformers.models.auto import modeling_auto

    return config.model_type in getattr(modeling_auto, _MAPPING_BY_TASK["seq2seq"])


def resolve_hf(name: str, task: str | None) -> HFSource | None:
    """None when `name` names no Hugging Face model memplan can find offline."""
    config = _load_config(name)
    if config is None:
        return None
    preset = get_preset(name) or preset_for_hub_id(name)
    guessed = False
    chosen = task or (preset.task if preset else None)
    from_config = chosen is None
    if chosen is None:
        chosen, guessed = _guess_task(config, name)
    if chosen is None:
        from memplan.errors import UsageError

        raise UsageError(
            f"cannot tell which head to train for {name!r} (model type {config.model_type}); "
            f"pass --task, one of {', '.join(TASKS)}, or give the model as your own module:function "
            "(docs/usage.md, custom models)"
        )
    if chosen == "seq2seq" and _builds_as_seq2seq(config) and getattr(config, "decoder_start_token_id", None) is None:
        # The training forward shifts the labels right to make the decoder's input, starting from this id
        # (T5's _shift_right, BART's shift_tokens_right): without it the run fails, as transformers 5's T5Config()
        # leaves it (the t5 model type's defaults; the hub's T5 configs set 0, the pad id).
        from memplan.errors import UsageError

        raise UsageError(
            f"{name!r} has no decoder_start_token_id, which a seq2seq model's training forward starts the decoder "
            'from: add it to the config (T5\'s checkpoints use "decoder_start_token_id": 0, the pad id), or use a '
            "preset (memplan presets)"
        )
    if chosen in (
        "sequence-classification",
        "image-classification",
        "token-classification",
        "semantic-segmentation",
        "audio-classification",
    ) and not getattr(config, "num_labels", None):
        config.num_labels = 2
    _check_sizes(config, name)
    return HFSource(
        name=name,
        config=config,
        task=chosen,
        guessed_class=_classes_of(config, chosen)[0] if guessed else None,
        other_tasks=_other_tasks_of_architecture(config, chosen) if from_config and not guessed else (),
    )


# Config fields that count something (layers, heads, widths, tokens, pixels): each at least 1. The
# names are transformers' canonical ones; a config's attribute_map (GPT-2's n_layer, T5's d_model)
# answers to them.
_SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "d_model",
    "d_ff",
    "d_kv",
    "num_layers",
    "num_decoder_layers",
    "num_heads",
    "head_dim",
    "image_size",
    "patch_size",
    "num_channels",
)


def _check_sizes(config: Any, name: str) -> None:
    """A negative or zero size builds an empty model or fails deep inside torch: say which field."""
    from memplan.errors import UsageError

    for field in _SIZE_FIELDS:
        if isinstance(getattr(type(config), field, None), property):
            # computed by the class, not given: XLNetConfig's max_position_embeddings is -1 for "no limit"
            continue
        try:
            value = getattr(config, field, None)
        except Exception:  # some configs compute fields from others, and may raise on bad ones
            continue
        if isinstance(value, bool) or not isinstance(value, int | list | tuple):
            continue
        values = value if isinstance(value, list | tuple) else [value]
        if any(isinstance(item, int) and item < 1 for item in values):
            alias = getattr(config, "attribute_map", {}).get(field)  # canonical name -> the config's own
            named = f"{field} ({alias})" if alias else field
            raise UsageError(f"the config of {name!r} has {named} = {value}; it must be at least 1: fix the config")


def build_hf_model(source: HFSource, attn_impl: str = "sdpa") -> Any:
    """Build with random initialisation in the active tensor mode (fake or real).

    `attn_impl` is transformers' attn_implementation: "sdpa" (its default where the architecture
    supports it) or "eager".
    """
    import transformers

    import_transformers_models()
    auto_class = getattr(transformers, _AUTO_CLASS_BY_TASK[source.task])
    config = source.config
    # (a vision-language config's language model reads its own: text_config.use_cache, True by default, had its
    # forward keep a KV cache, and a checkpointed layer's recomputation append to it)
    for part in (config, getattr(config, "text_config", None)):
        if hasattr(part, "use_cache"):
            part.use_cache = False
    unset_problem = hasattr(config, "problem_type") and config.problem_type is None
    if source.task == "sequence-classification" and unset_problem and config.num_labels > 1:
        # The batch's labels are class indices (batches.synthesize_batch), which a head's first forward reads
        # as "single_label_classification" (BERT's, Llama's: `labels.dtype == torch.long`). DeBERTa and
        # DeBERTa-v2 read a config without it otherwise: `label_index = (labels >= 0).nonzero()`
        # (modeling_deberta.py), a data-dependent shape fake tensors cannot trace (a false refusal of every
        # DeBERTa classifier). With every label >= 0, as here, that path gathers all rows and runs the same
        # cross entropy; its identity gathers are the only difference, a few B * num_labels bytes, which the
        # prediction leaves out (low by that much where the loss is the peak, as it was in no case measured).
        config.problem_type = "single_label_classification"
    if getattr(config, "architectures", []) is None:
        # transformers' auto classes iterate it where the task maps to several classes (DeiT's image
        # classification: with and without a teacher) and fail on a config.json written without it
        # ("'NoneType' object is not iterable", auto_factory.py `_get_model_class`); none named picks the first.
        config.architectures = []
    try:
        if attn_impl == "sdpa":
            # transformers' own default: SDPA where the architecture supports it, eager elsewhere.
            return auto_class.from_config(config)
        return auto_class.from_config(config, attn_implementation=attn_impl)
    except (ValueError, KeyError, AssertionError) as error:
        if isinstance(error, AssertionError) and not _asserted_by_a_module(error):
            raise  # an assertion of torch's fake tensors or memplan's own: not the config's
        # A config's values the architecture does not know ("activation_function": "nope" is a KeyError of its
        # ACT2FN table; "rope_scaling" of an unknown type) or its modules' constructors assert against (a
        # pad_token_id past vocab_size: nn.Embedding's "Padding_idx must be within num_embeddings") are the
        # config's mistake. (A TypeError is left to say itself as an internal error: under fake tensors it may be
        # memplan's.)
        from memplan.errors import UsageError

        text = str(error).strip()
        said = text.splitlines()[0] if text else type(error).__name__
        if isinstance(error, KeyError):
            said = f"it names {said}, which the architecture does not know"
        article = "an" if source.task[0] in "aeiou" else "a"
        raise UsageError(
            f"transformers cannot build {article} {source.task} model of type {config.model_type} from this config "
            f"({said}): fix the config, or pick another --task"
        ) from error
