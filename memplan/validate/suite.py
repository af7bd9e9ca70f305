"""Built-in validation suites, and the results file a suite run appends to as it goes.

The results file is one JSON document (`device_name`, `torch_version`, `suite`, `configs`),
rewritten after every configuration, so an interrupted run keeps what it measured and `--resume`
skips the configurations already in it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError, UsageError
from memplan.outputs import write_atomically
from memplan.validate.result import ValidationResult


@dataclass(frozen=True)
class SuiteConfig:
    id: str
    model: str
    settings: dict[str, Any] = field(default_factory=dict)  # TrainingSettings fields besides the device
    inputs: str | None = None  # a custom model's batch (package.module:fn)


def _c(id: str, model: str, **settings: Any) -> SuiteConfig:
    return SuiteConfig(id, model, settings)


UNET = "memplan.validate.zoo:unet"
VGG16 = "memplan.validate.zoo:vgg16"


def _unet(id: str, **settings: Any) -> SuiteConfig:
    return SuiteConfig(id, UNET, settings, inputs="memplan.validate.zoo:unet_inputs")


def _vgg16(id: str, **settings: Any) -> SuiteConfig:
    return SuiteConfig(id, VGG16, settings, inputs="memplan.validate.zoo:vgg16_inputs")


# Sized for one 80 GB GPU; every architecture memplan's presets cover except the 7-8B models,
# whose AdamW state alone (16 bytes per parameter) exceeds 80 GB.
MAIN = (
    _c("gpt2-fp32-adamw", "gpt2", batch_size=8, seq_len=1024),
    _c("gpt2-amp-bf16", "gpt2", batch_size=8, seq_len=1024, precision="amp-bf16"),
    _c("gpt2-amp-fp16", "gpt2", batch_size=8, seq_len=1024, precision="amp-fp16"),
    _c("gpt2-bf16", "gpt2", batch_size=16, seq_len=1024, precision="bf16"),
    _c("gpt2-checkpoint-all", "gpt2", batch_size=8, seq_len=1024, checkpoint="all"),
    _c("gpt2-sgd-accum4", "gpt2", batch_size=4, seq_len=1024, optimizer="sgd", grad_accum=4),
    _c("gpt2-eager-attention", "gpt2", batch_size=4, seq_len=1024, precision="amp-bf16", attn_impl="eager"),
    _c("gpt2-medium-amp-bf16", "gpt2-medium", batch_size=4, seq_len=1024, precision="amp-bf16"),
    _c("bert-large-amp-bf16", "bert-large-uncased", batch_size=16, seq_len=512, precision="amp-bf16"),
    _c("bert-large-checkpoint", "bert-large-uncased", batch_size=8, seq_len=512, checkpoint="all"),
    _c("distilbert-fp32", "distilbert-base-uncased", batch_size=32, seq_len=512),
    _c(
        "distilbert-amp-fp16-sgd",
        "distilbert-base-uncased",
        batch_size=32,
        seq_len=512,
        precision="amp-fp16",
        optimizer="sgd-momentum",
    ),
    _c("t5-base-adafactor", "t5-base", batch_size=8, seq_len=512, optimizer="adafactor"),
    _c("t5-small-amp-bf16", "t5-small", batch_size=32, seq_len=512, precision="amp-bf16"),
    _c("qwen2.5-0.5b-amp-bf16", "qwen2.5-0.5b", batch_size=4, seq_len=1024, precision="amp-bf16"),
    _c("qwen2.5-0.5b-bf16-checkpoint", "qwen2.5-0.5b", batch_size=8, seq_len=1024, precision="bf16", checkpoint="all"),
    _c("qwen2.5-0.5b-fp32", "qwen2.5-0.5b", batch_size=2, seq_len=2048),
    _c("vit-base-amp-bf16", "vit-base-patch16-224", batch_size=64, precision="amp-bf16"),
    _c("vit-base-fp32-sgd", "vit-base-patch16-224", batch_size=32, optimizer="sgd"),
    _c("resnet-50-fp32-sgd-momentum", "resnet-50", batch_size=64, optimizer="sgd-momentum"),
    _c("resnet-50-amp-fp16", "resnet-50", batch_size=64, precision="amp-fp16"),
    _c("resnet-101-accum2", "resnet-101", batch_size=32, grad_accum=2),
    _c("resnet-101-bf16-sgd", "resnet-101", batch_size=50, precision="bf16", optimizer="sgd"),
    # The allocator as people configure it (PYTORCH_CUDA_ALLOC_CONF, set in the measured process):
    # the reserved peaks the expandable path and max_split_size_mb predict.
    _c("gpt2-expandable-segments", "gpt2", batch_size=8, seq_len=1024, cuda_alloc_conf="expandable_segments:True"),
    _c(
        "qwen2.5-0.5b-expandable-segments",
        "qwen2.5-0.5b",
        batch_size=2,
        seq_len=2048,
        cuda_alloc_conf="expandable_segments:True",
    ),
    _c("resnet-50-expandable-segments", "resnet-50", batch_size=64, cuda_alloc_conf="expandable_segments:True"),
    _c("resnet-50-max-split-size", "resnet-50", batch_size=64, cuda_alloc_conf="max_split_size_mb:64"),
)

# Beyond the main suite, on the same 80 GB GPU: ViT-L/16, grouped-query attention (Llama-3.2-1B,
# Qwen2.5-0.5B), conv nets with cuDNN's benchmark mode on and off (and without TF32), a U-Net,
# BERT-large under the HF Trainer loop, every --loop variant, selective and planned checkpointing,
# fp16 autocast with checkpointing and accumulation, Adafactor, a cuBLAS workspace setting.
EXTENDED = (
    _c("vit-large-amp-bf16-accum2", "vit-large-patch16-224", batch_size=32, precision="amp-bf16", grad_accum=2),
    _c("vit-large-fp32-checkpoint", "vit-large-patch16-224", batch_size=32, checkpoint="all"),
    _c("llama-3.2-1b-amp-bf16", "llama-3.2-1b", batch_size=4, seq_len=1024, precision="amp-bf16"),
    _c("llama-3.2-1b-bf16-checkpoint", "llama-3.2-1b", batch_size=8, seq_len=2048, precision="bf16", checkpoint="all"),
    _c("llama-3.2-1b-fp32", "llama-3.2-1b", batch_size=2, seq_len=1024),
    _c(
        "llama-3.2-1b-adafactor",
        "llama-3.2-1b",
        batch_size=4,
        seq_len=1024,
        precision="amp-bf16",
        optimizer="adafactor",
    ),
    _c(
        "qwen2.5-0.5b-selective",
        "qwen2.5-0.5b",
        batch_size=8,
        seq_len=1024,
        precision="amp-bf16",
        checkpoint="selective",
    ),
    _c(
        "qwen2.5-0.5b-eager-attention",
        "qwen2.5-0.5b",
        batch_size=4,
        seq_len=1024,
        precision="amp-bf16",
        attn_impl="eager",
    ),
    _c("resnet-50-cudnn-benchmark", "resnet-50", batch_size=64, cudnn_benchmark=True),
    _c("resnet-101-amp-bf16-benchmark", "resnet-101", batch_size=64, precision="amp-bf16", cudnn_benchmark=True),
    _c("resnet-50-no-tf32", "resnet-50", batch_size=64, cudnn_allow_tf32=False),
    _unet("unet-fp32", batch_size=8),
    _unet("unet-fp32-benchmark", batch_size=8, cudnn_benchmark=True),
    _unet("unet-amp-bf16", batch_size=16, precision="amp-bf16"),
    # GPUMemNet's A100 row that memplan misses by 21% (docs/validation.md): the same step on this GPU
    _vgg16("vgg16-fp32-adam-b64", batch_size=64, optimizer="adam"),
    _c(
        "bert-large-hf-trainer",
        "bert-large-uncased",
        batch_size=16,
        seq_len=512,
        precision="amp-bf16",
        loop="hf-trainer",
    ),
    _c("gpt2-zero-grad-before-backward", "gpt2", batch_size=8, seq_len=1024, loop="zero-grad-before-backward"),
    _c("gpt2-set-to-none-false", "gpt2", batch_size=8, seq_len=1024, loop="set-to-none-false"),
    _c("gpt2-keep-output", "gpt2", batch_size=8, seq_len=1024, loop="keep-output"),
    _c(
        "gpt2-medium-amp-fp16-checkpoint-accum2",
        "gpt2-medium",
        batch_size=8,
        seq_len=1024,
        precision="amp-fp16",
        checkpoint="all",
        grad_accum=2,
    ),
    _c(
        "gpt2-medium-planned",
        "gpt2-medium",
        batch_size=16,
        seq_len=1024,
        precision="amp-bf16",
        checkpoint="docs/validation/plans/gpt2-medium-b16-amp-bf16-20GiB.json",
        gpu="H100-80GB",  # the plan was made for it; a plan refuses other settings
    ),
    _c("t5-base-selective-long", "t5-base", batch_size=8, seq_len=1024, checkpoint="selective"),
    _c("gpt2-cublas-workspace", "gpt2", batch_size=8, seq_len=1024, cublas_workspace_config=":4096:8"),
    # One DDP rank (memplan.distributed.ddp): on one GPU the real run's group is the fake one too,
    # so what it measures is DDP's own memory (its buckets, copies and broadcasts) without NCCL's.
    _c("gpt2-ddp-8", "gpt2", batch_size=8, seq_len=1024, precision="amp-bf16", parallel="ddp", world_size=8),
    _c(
        "llama-3.2-1b-ddp-accum2",
        "llama-3.2-1b",
        batch_size=2,
        seq_len=1024,
        precision="amp-bf16",
        checkpoint="all",
        grad_accum=2,
        parallel="ddp",
        world_size=4,
    ),
    # One ZeRO-1 rank (memplan.distributed.zero): DDP and torch's ZeroRedundancyOptimizer, rank 0's
    # share of the AdamW state (GPT-2's embedding whole), its parameter broadcasts in place.
    _c("gpt2-zero1-8", "gpt2", batch_size=8, seq_len=1024, precision="amp-bf16", parallel="zero1", world_size=8),
    # One FSDP2 rank (memplan.distributed.fsdp): its collectives on their own CUDA streams, which the
    # fake group's collectives run on too (they move nothing), with the copies and resizes around them.
    _c("gpt2-fsdp-8", "gpt2", batch_size=8, seq_len=1024, precision="amp-bf16", parallel="fsdp", world_size=8),
    _c(
        "llama-3.2-1b-fsdp-grad-op-checkpoint",
        "llama-3.2-1b",
        batch_size=4,
        seq_len=1024,
        precision="bf16",
        checkpoint="all",
        parallel="fsdp-grad-op",
        world_size=4,
    ),
)

# QLoRA (memplan.finetune.quantize): needs bitsandbytes on the GPU machine (docs/validation.md says
# how to carry it). Rows of 4,096 tokens per matmul take bitsandbytes' dequantizing kernel on CUDA;
# the 512-token one may take its fused kernel, which memplan counts as the dequantizing one.
_QLORA = {"precision": "amp-bf16", "lora_rank": 16, "quantize": "nf4"}
QLORA = (
    _c("llama-3.2-1b-qlora-checkpoint", "llama-3.2-1b", batch_size=4, seq_len=1024, checkpoint="all", **_QLORA),
    _c("llama-3.2-1b-qlora-short", "llama-3.2-1b", batch_size=1, seq_len=512, **_QLORA),
    _c(
        "llama-3.2-1b-qlora-paged",
        "llama-3.2-1b",
        batch_size=4,
        seq_len=1024,
        optimizer="paged-adam8bit",
        lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        **_QLORA,
    ),
    _c(
        "qwen2.5-0.5b-qlora-bf16-no-upcast",
        "qwen2.5-0.5b",
        batch_size=8,
        seq_len=1024,
        precision="bf16",
        lora_rank=16,
        quantize="fp4",
        kbit_upcast=False,
    ),
    # LLM.int8() base weights: MatMul8bitLt on CUDA, whose outlier columns memplan assumes (1%).
    _c(
        "llama-3.2-1b-int8-lora-checkpoint",
        "llama-3.2-1b",
        batch_size=4,
        seq_len=1024,
        checkpoint="all",
        **{**_QLORA, "quantize": "int8"},
    ),
    _c("qwen2.5-0.5b-int8-lora", "qwen2.5-0.5b", batch_size=4, seq_len=512, **{**_QLORA, "quantize": "int8"}),
)

# Two-layer models that measure in seconds on a CPU: `memplan validate --suite smoke --device cpu`.
SMOKE = (
    _c("tiny-gpt2-fp32", "tiny-gpt2", batch_size=2, seq_len=64),
    _c("tiny-gpt2-checkpoint-accum", "tiny-gpt2", batch_size=2, seq_len=64, checkpoint="all", grad_accum=2),
    _c("tiny-llama-amp-bf16", "tiny-llama", batch_size=2, seq_len=64, precision="amp-bf16", optimizer="sgd"),
)

SUITES = {"main": MAIN, "extended": EXTENDED, "qlora": QLORA, "smoke": SMOKE}


def suite_named(name: str) -> tuple[SuiteConfig, ...]:
    if name not in SUITES:
        raise UsageError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return SUITES[name]


def load_results(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = "not UTF-8 text" if isinstance(error, UnicodeDecodeError) else str(error)
        raise UsageError(
            f"cannot read results file {path} ({reason}); pass another --results or drop --resume"
        ) from error
    if not isinstance(document, dict) or not isinstance(document.get("configs"), list):
        raise UsageError(f"{path} is not a memplan validation results file")
    for number, entry in enumerate(document["configs"], start=1):
        problem = _entry_problem(entry)
        if problem is not None:  # said now, not after the suite has run (the summary reads every entry)
            raise UsageError(
                f"{path}: result {number} {problem}; it is not a result this memplan wrote: pass another --results "
                "file, or drop --resume and --force to start this one over"
            )
    return document


_BYTE_FIELDS = tuple(item.name for item in fields(ValidationResult) if item.name.endswith("_bytes"))


def _entry_problem(entry: object) -> str | None:
    """What keeps a results file's entry from being read as a result, or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
        return "has no configuration id"
    try:
        ValidationResult.from_dict(entry)
    except TypeError as error:  # a field missing (an older layout)
        return f"cannot be read ({error})"
    wrong = [
        name
        for name in _BYTE_FIELDS
        if not isinstance(entry.get(name), int | None) or isinstance(entry.get(name), bool)
    ]
    return f"has {wrong[0]} = {entry[wrong[0]]!r}, not a byte count" if wrong else None


def result_rows(document: dict[str, Any]) -> list[tuple[str, ValidationResult]]:
    """The (config id, result) pairs of a results document, in the order they were measured."""
    return [(entry["id"], ValidationResult.from_dict(entry)) for entry in document["configs"]]


def _write_atomically(path: Path, document: dict[str, Any]) -> None:
    text = (json.dumps(document, indent=2) + "\n").encode()
    write_atomically(path, lambda file: file.write(text), "results")


def run_suite(
    name: str,
    configs: tuple[SuiteConfig, ...],
    results_path: Path,
    measure: Callable[[SuiteConfig], ValidationResult],
    *,
    device: str,
    resume: bool = False,
    replace: bool = False,
) -> Iterator[tuple[SuiteConfig, ValidationResult | None]]:
    """Measure each configuration, writing the results file after each; yields (config, result or None if resumed).
    An existing results file is continued with `resume`, started over with `replace` (at the first result
    written: until then it is kept), and otherwise refused.

    A configuration whose prediction or measurement fails is recorded as a failed result, with
    the reason, and the suite goes on (measurement failures, OOM and time-outs already come back
    as results; this covers what raises).
    """
    for flag, value in (("resume", resume), ("replace", replace)):
        if not isinstance(value, bool):  # "no" is truthy: read as True it started a results file over
            raise UsageError(f"{flag} must be True or False, got {value!r} ({type(value).__name__})")
    if resume and replace:
        raise UsageError("resume continues the results file and replace starts it over: give one of them")
    if results_path.exists() and not resume and not replace:
        raise UsageError(
            f"{results_path} exists: pass --resume to continue it, --force to start it over, or another --results file"
        )
    document = load_results(results_path) if resume and results_path.exists() else {"suite": name, "configs": []}
    if document.get("suite") != name:
        raise UsageError(f"{results_path} holds suite {document.get('suite')!r}, not {name!r}")
    _check_same_machine(document, results_path, device)
    done = {entry["id"] for entry in document["configs"]}
    for config in configs:
        if config.id in done:
            yield config, None
            continue
        try:
            result = measure(config)
        except UsageError:
            raise  # the suite itself is wrong: nothing later would go better
        except MemplanError as error:  # this configuration failed (a trace error): record it, go on
            result = failed_result(config, device, error)
        _check_recorded(document, results_path, "device_name", result.device_name, "measured on")
        document.setdefault("device_name", result.device_name)
        document.setdefault("torch_version", result.torch_version)
        document["configs"].append({"id": config.id, **result.to_dict()})
        _write_atomically(results_path, document)
        yield config, result


def _check_same_machine(document: dict[str, Any], path: Path, device: str) -> None:
    """A results file is continued (--resume) only where it was begun: the same --device and torch (the device's
    name is checked at the first new result), or one file would mix measurements under one header and summary."""
    import torch

    other = sorted({str(entry.get("device")) for entry in document["configs"] if "device" in entry} - {device})
    if other:
        raise UsageError(
            f"{path} was measured with --device {other[0]}: continue it with --device {other[0]}, or give another "
            "--results file"
        )
    _check_recorded(document, path, "torch_version", torch.__version__, "measured with torch")


def _check_recorded(document: dict[str, Any], path: Path, key: str, value: str, what: str) -> None:
    recorded = document.get(key)
    if recorded not in (None, "unknown") and value != "unknown" and recorded != value:
        raise UsageError(
            f"{path} was {what} {recorded}, and this run is {what} {value}: continue it there, or give another "
            "--results file"
        )


def failed_result(config: SuiteConfig, device: str, error: Exception) -> ValidationResult:
    return ValidationResult(
        model=config.model,
        settings={**config.settings, "device": device},
        device=device,
        predicted_peak_bytes=None,
        measured_peak_bytes=None,
        predicted_reserved_bytes=None,
        measured_reserved_bytes=None,
        predicted_device_bytes=None,
        measured_device_bytes=None,
        device_name="unknown",
        torch_version="unknown",
        error=f"{type(error).__name__}: {error}",
    )


def summary(results: list[ValidationResult]) -> dict[str, float | int | None]:
    """Median and largest |relative error| over the measured configurations."""
    peak = [abs(r.relative_error) for r in results if r.relative_error is not None]
    reserved = [abs(r.reserved_relative_error) for r in results if r.reserved_relative_error is not None]
    return {
        "measured": len(peak),
        "failed": len(results) - len(peak),
        "median_abs_error": statistics.median(peak) if peak else None,
        "max_abs_error": max(peak) if peak else None,
        "median_abs_reserved_error": statistics.median(reserved) if reserved else None,
    }
