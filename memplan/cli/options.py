"""The options that describe one training iteration, shared by the commands, and the flags
--quiet and --force that the run reads back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from memplan.distributed.modes import FSDP_MIXED_PRECISIONS, OFFLOAD_MODES, PARALLEL_MODES
from memplan.errors import SizeParseError
from memplan.settings import (
    ATTENTION_IMPLEMENTATIONS,
    DEVICES,
    LOOPS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    QUANT_TYPES,
)
from memplan.sizes import parse_size


class SizeType(click.ParamType):
    """A memory size: 80GB, 24GiB, 512MiB or plain bytes."""

    name = "size"

    def __init__(self, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero  # bytes held outside the allocator (--cuda-context, --nccl-memory) can be none

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value, allow_zero=self.allow_zero)
        except SizeParseError as error:
            self.fail(str(error), param, ctx)


def _deepspeed_config_text(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """--deepspeed's file, read: its JSON text (TrainingSettings.deepspeed_config); the path is kept
    among the command's input files, which no output may overwrite."""
    if path is None:
        return None
    import json

    from memplan.distributed.deepspeed_file import parse_deepspeed_config
    from memplan.errors import SettingsError

    try:
        with open(path, encoding="utf-8") as handle:
            config = parse_deepspeed_config(handle.read())
    except (OSError, UnicodeDecodeError, SettingsError) as error:
        raise click.BadParameter(f"{path}: {error}", ctx, param) from error
    ctx.meta["memplan.deepspeed_path"] = path
    return json.dumps(config, sort_keys=True)


def _quiet() -> bool:
    context = click.get_current_context(silent=True)
    return bool(context is not None and context.find_root().meta.get("memplan.quiet"))


def _set_force(context: click.Context, parameter: click.Parameter, value: bool) -> None:
    if value:
        context.find_root().meta["memplan.force"] = True


def _set_quiet(context: click.Context, parameter: click.Parameter, value: bool) -> None:
    if value:
        context.find_root().meta["memplan.quiet"] = True


def _training_options(command: Callable[..., None], model_required: bool = True) -> Callable[..., None]:
    """The options that describe one training iteration, shared by estimate, plan and validate."""
    options = [
        click.argument("model", required=model_required),
        click.option("--batch-size", "-b", type=int, default=1, show_default=True, help="Micro-batch size."),
        click.option(
            "--seq-len",
            type=int,
            help="Sequence length for text models [default: min(512, maximum)]; speech-seq2seq: input frames "
            "(Whisper: its one length, 2 x max_source_positions; others min(3000, maximum)); ctc, "
            "audio-classification: audio samples [default: 16000, one second at 16 kHz] (Whisper's, AST's: the one "
            "frame count their encoders take); zero-shot-image-classification: caption tokens [default: min(77, the "
            "text tower's maximum)]; image-text-to-text: all the tokens, the image's placeholders included [default: "
            "512, or 512 beside placeholders of 512 or more; at most the maximum].",
        ),
        click.option(
            "--target-len",
            type=int,
            help="Decoder length for seq2seq models [default: --seq-len]; speech-seq2seq: label tokens [default: "
            "min(448, max_target_positions)]; ctc: labels per sample, at most the encoder's frames [default: "
            "min(32, frames)].",
        ),
        click.option(
            "--image-size",
            type=int,
            help="Image side for vision models [default: the config's, or 224]; zero-shot-image-classification: "
            "the vision tower's one size; image-text-to-text: the side the vision tower takes (LLaVA, PaliGemma, "
            "Gemma 3: vision_config's only; Idefics3/SmolVLM: the longest edge the processor resizes to, cut into "
            "tiles of the tower, default 4 tiles a side (the tower's size: one tile, not split); Qwen2-VL, "
            "Qwen2.5-VL: a multiple of 28, Qwen3-VL: of 32, default 224; LLaVA-NeXT, LLaVA-OneVision: the original "
            "image's, any, default the largest grid pinpoint's; Idefics2 (one tile, not split): vision_config's only; "
            "Mistral 3, LLaVA over Pixtral: the resized image's, a multiple of the patch a placeholder stands for, "
            "default and at most vision_config's; Mllama: vision_config's only).",
        ),
        click.option("--grad-accum", type=int, default=1, show_default=True, help="Gradient accumulation steps."),
        click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True),
        click.option(
            "--optimizer-impl",
            type=click.Choice(OPTIMIZER_IMPLS),
            default="default",
            show_default=True,
            help="default = what torch picks on the target device (foreach on CUDA, for-loop on CPU).",
        ),
        click.option(
            "--device", type=click.Choice(DEVICES), default="cuda", show_default=True, help="The target device."
        ),
        click.option(
            "--gpu",
            metavar="NAME",
            help="The card: its compute capability picks CUDA kernels, and its usable memory is the budget "
            "unless --budget is given (H100-80GB, H200, A100-40GB, A100-80GB, L4, A10G, RTX-4090, T4, ...). "
            "`estimate` takes a comma-separated list: which of the cards it fits, and the cheapest that it does.",
        ),
        click.option(
            "--attn-impl",
            type=click.Choice(ATTENTION_IMPLEMENTATIONS),
            default="sdpa",
            show_default=True,
            help="transformers' attn_implementation (sdpa where the architecture supports it).",
        ),
        click.option(
            "--lora",
            "lora_rank",
            type=int,
            metavar="RANK",
            help="Train LoRA adapters of this rank (built with peft: pip install 'memplan[peft]'); the model's "
            "own weights are frozen.",
        ),
        click.option("--lora-alpha", type=float, help="LoRA's lora_alpha [default: peft's]."),
        click.option(
            "--lora-targets",
            metavar="NAMES",
            help="Comma-separated module names the adapters go on [default: peft's for the architecture].",
        ),
        click.option("--lora-dropout", type=float, default=0.0, show_default=True, help="LoRA's lora_dropout."),
        click.option(
            "--quantize",
            type=click.Choice(QUANT_TYPES),
            help="QLoRA: the base model's linear layers in bitsandbytes' 4-bit layout (nf4, fp4: double-quantized, "
            "computed in the precision's 16-bit dtype) or LLM.int8()'s (int8: outlier threshold 6.0); needs --lora "
            "(pip install 'memplan[qlora]').",
        ),
        click.option(
            "--kbit-upcast/--no-kbit-upcast",
            default=True,
            show_default=True,
            help="With --quantize: peft's prepare_model_for_kbit_training casts the layers left in 16 bits "
            "(embeddings, norms, LM head) to float32.",
        ),
        click.option(
            "--cuda-context",
            type=SizeType(allow_zero=True),
            help="The CUDA context nvidia-smi shows beyond what torch reserves (e.g. 600MiB), counted in the "
            "device total and taken off --gpu's memory [default: 767 MiB, measured on an H100 with CUDA 13].",
        ),
        click.option(
            "--cudnn-benchmark",
            is_flag=True,
            help="The run sets torch.backends.cudnn.benchmark = True (convolutions: see docs/concepts.md).",
        ),
        click.option(
            "--deterministic",
            is_flag=True,
            help="The run calls torch.use_deterministic_algorithms(True) (flash attention's backward keeps more).",
        ),
        click.option(
            "--cudnn-tf32/--no-cudnn-tf32",
            "cudnn_allow_tf32",
            default=True,
            show_default=True,
            help="torch.backends.cudnn.allow_tf32: off, fp32 convolutions leave tensor cores (no workspace band).",
        ),
        click.option(
            "--cudnn-workspace-cap",
            "cudnn_workspace_cap_mib",
            type=click.IntRange(min=0),
            metavar="MIB",
            envvar="CUDNN_CONV_WSCAP_DBG",
            show_envvar=True,
            help="Cap each cuDNN convolution workspace at MIB MiB, as CUDNN_CONV_WSCAP_DBG does.",
        ),
        click.option(
            "--cublas-workspace-config",
            metavar=":SIZE:COUNT",
            envvar="CUBLAS_WORKSPACE_CONFIG",
            show_envvar=True,
            help="The run's CUBLAS_WORKSPACE_CONFIG (e.g. :4096:8 or :16:8): the size of each cuBLAS workspace.",
        ),
        click.option(
            "--cuda-alloc-conf",
            metavar="KEY:VALUE,...",
            # torch 2.11+ reads PYTORCH_ALLOC_CONF where PYTORCH_CUDA_ALLOC_CONF is unset (CUDAAllocatorConfig.h,
            # instance()); click takes the first of these that is set, the same order
            envvar=["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"],
            show_envvar=True,
            help="The run's PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF): expandable_segments, max_split_size_mb, "
            "max_non_split_rounding_mb, roundup_power2_divisions and large_segment_size_mb are simulated, "
            "per_process_memory_fraction caps a --gpu's budget; other keys are noted.",
        ),
        click.option(
            "--loop",
            type=click.Choice(LOOPS),
            default="canonical",
            show_default=True,
            help="The training loop: where zero_grad runs and what stays alive (docs/concepts.md); "
            "--hf-args picks hf-trainer.",
        ),
        click.option(
            "--parallel",
            type=click.Choice(PARALLEL_MODES),
            default="none",
            show_default=True,
            help="Data parallelism, one rank traced: ddp is torch's DistributedDataParallel (its gradient buckets "
            "included); zero1 is DDP with torch's ZeroRedundancyOptimizer (ZeRO stage 1: the optimizer state "
            "sharded, whole parameters per rank); fsdp is FSDP2's fully_shard on each repeated block and the root "
            "(parameters, gradients and optimizer state sharded), fsdp-grad-op the same without resharding after "
            "the forward, hsdp the same sharded within groups of --shard-size ranks and replicated across them. "
            "Batch settings are per rank.",
        ),
        click.option(
            "--world-size",
            type=int,
            default=1,
            show_default=True,
            help="Data-parallel ranks with --parallel (the total batch is micro-batch × accumulation × ranks).",
        ),
        click.option(
            "--shard-size",
            type=int,
            default=None,
            help="With --parallel hsdp: the ranks each shard group spans (a divisor of --world-size; often one "
            "node's GPUs), FSDP2 on a 2-D mesh of world-size / shard-size replicas.",
        ),
        click.option(
            "--offload",
            type=click.Choice(OFFLOAD_MODES),
            default="none",
            show_default=True,
            help="With --parallel fsdp, fsdp-grad-op or hsdp: params is FSDP2's CPUOffloadPolicy (the shards, their "
            "gradients and the optimizer state in host memory, the optimizer step run there; each module's shards "
            "copied to the GPU for its all-gather). With --parallel zero2 or zero3 (or zero1 with --deepspeed): "
            "optimizer is DeepSpeed's offload_optimizer (the float32 master partition, its gradient and the optimizer "
            "state in host memory, the step run there); with zero3, params is that and offload_param (the "
            "parameter partitions on the host too), added to what a --deepspeed file offloads by itself. The GPU "
            "figures leave the host's share out and host_peak_bytes counts it.",
        ),
        click.option(
            "--ddp-bucket-view",
            is_flag=True,
            help="With --parallel ddp or zero1: DistributedDataParallel(gradient_as_bucket_view=True), the gradients "
            "views into DDP's buckets instead of a second copy.",
        ),
        click.option(
            "--deepspeed",
            "deepspeed_config",
            type=click.Path(exists=True, dir_okay=False),
            callback=_deepspeed_config_text,
            metavar="DS_CONFIG.json",
            help="With --parallel zero2 or zero3 (or zero1: DeepSpeed's stage 1 instead of torch's "
            "ZeroRedundancyOptimizer): the job's DeepSpeed configuration, whose zero_optimization section "
            "(reduce_bucket_size, overlap_comm, contiguous_gradients, stage3_* thresholds) DeepSpeed applies as it "
            "runs; the batch, accumulation, precision and optimizer come from memplan's options.",
        ),
        click.option(
            "--fsdp-mixed-precision",
            type=click.Choice(FSDP_MIXED_PRECISIONS),
            help="With --parallel fsdp: FSDP2's MixedPrecisionPolicy, float32 shards gathered and computed in this "
            "dtype, gradients reduced in float32 (torchtitan's default).",
        ),
        click.option(
            "--nccl-memory",
            type=SizeType(allow_zero=True),
            help="With --parallel on the cuda target: what NCCL's communicator holds on the GPU, outside torch's "
            "allocator (e.g. 500MiB), counted in the device total and taken off --gpu's memory [default: the top "
            "of memplan's modelled band, 1,152-1,408 MiB on 8 ranks of one node].",
        ),
        click.option(
            "--nccl-buffsize",
            type=click.IntRange(min=1),
            metavar="BYTES",
            envvar="NCCL_BUFFSIZE",
            show_envvar=True,
            help="With --parallel: the job's NCCL_BUFFSIZE (NCCL's Simple buffer per connection, 4 MiB by default).",
        ),
        click.option(
            "--nccl-max-ctas",
            type=click.IntRange(min=1),
            metavar="N",
            envvar=["NCCL_MAX_CTAS", "NCCL_MAX_NCHANNELS"],
            show_envvar=True,
            help="With --parallel: the job's NCCL_MAX_CTAS (or NCCL_MAX_NCHANNELS), a cap on NCCL's channels.",
        ),
        click.option(
            "--nccl-nvls/--no-nccl-nvls",
            default=True,
            envvar="NCCL_NVLS_ENABLE",
            show_envvar=True,
            help="With --parallel on Hopper: whether NCCL may use NVLink SHARP (NCCL_NVLS_ENABLE=0 turns it off).",
        ),
        click.option(
            "--step",
            metavar="MODULE:FN",
            help="Your own training iteration instead of the loop: fn(model, batch, optimizer) runs one "
            "(forward passes, losses, backward, optimizer step, zero_grad as you write them; docs/usage.md).",
        ),
        click.option(
            "--task",
            help="Head for transformers models: causal-lm, masked-lm, sequence-classification, seq2seq, "
            "image-classification, semantic-segmentation (SegFormer, BEiT, DPT, MobileViT, UperNet; --image-size), "
            "speech-seq2seq (Whisper, Speech2Text), ctc (wav2vec2, HuBERT, WavLM, ...), "
            "audio-classification (wav2vec2, HuBERT, WavLM, Whisper, AST, ...), zero-shot-image-classification "
            "(CLIP, SigLIP: their contrastive loss, return_loss=True), token-classification, question-answering, "
            "multiple-choice (4 choices of --seq-len tokens each), image-text-to-text (LLaVA, Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL, PaliGemma, Gemma 3: its checkpoints train on text alone without this --task, LLaVA-NeXT, "
            "LLaVA-OneVision, Idefics2, Idefics3/SmolVLM).",
        ),
        click.option(
            "--hf-args",
            type=click.Path(dir_okay=False),
            help="A Hugging Face TrainingArguments JSON/YAML file: batch size, accumulation, bf16/fp16, "
            "activation (gradient) checkpointing, optim and label_smoothing_factor (memplan.hf_args lists the "
            "fields read and noted); flags given explicitly override it.",
        ),
        click.option("--inputs", help="package.module:fn where fn(batch_size) returns the batch (custom models)."),
        click.option("--loss", help="package.module:fn where fn(output, batch) returns the scalar loss."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout."),
        click.option(
            "--quiet",
            "-q",
            is_flag=True,
            expose_value=False,
            callback=_set_quiet,
            help="No progress, notes or file messages on stderr (errors still print).",
        ),
        click.option(
            "--force",
            is_flag=True,
            expose_value=False,
            callback=_set_force,
            help="Replace output files that exist (--plot, --snapshot, --output where a command has one); inputs stay.",
        ),
        click.option("--debug", is_flag=True, help="Show tracebacks."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _cache_option(command: Callable[..., None]) -> Callable[..., None]:
    """--no-cache, for the commands whose answers memplan keeps (memplan.cli.cache)."""
    return click.option(
        "--no-cache",
        is_flag=True,
        help="Trace even if this command's answer is in memplan's cache (MEMPLAN_NO_CACHE=1 for every command).",
    )(command)
