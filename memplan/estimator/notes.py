"""The notes an estimate prints beside its figures: what the target emulates, and what the settings change,
model in a band or leave out (memplan.estimator.estimate)."""

from __future__ import annotations

from typing import Any

import torch

from memplan.distributed.deepspeed_file import replaced_values
from memplan.distributed.modes import FSDP_MODES, RESHARDING_FSDP_MODES
from memplan.finetune.bnb_kernels import OUTLIER_COLUMN_FRACTION
from memplan.finetune.quantize import INT8
from memplan.gpus import DEFAULT_GPU
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes


def settings_notes(settings: TrainingSettings, has_convolutions: bool = False, paged_bytes: int = 0) -> list[str]:
    """What an estimate says of its settings beside its figures: what the target emulates, and what each
    setting changes or leaves out (`has_convolutions`: the step ran cuDNN convolutions; `paged_bytes`:
    paged-adam8bit's state in unified memory)."""
    notes = []
    if settings.device == "cuda":
        notes.append(
            f"cuda target ({settings.gpu or DEFAULT_GPU}): CUDA's autocast lists, SDPA backend, fused dropout, "
            "cuBLAS workspaces and the caching allocator are emulated; cuDNN convolution workspaces are a band "
            "(memplan cannot know the algorithm cuDNN picks): its top is what is reported; a fit replays the step "
            "at the budget with both ends (the allocator frees cached memory and retries when short)"
        )
        if settings.cuda_context is None:
            notes.append(
                f"device_peak_bytes counts a CUDA context of {format_bytes(settings.context_bytes)}, as measured "
                "on an H100 with CUDA 13 (torch 2.11); it depends on the CUDA version, lazy loading and GPU: "
                "give yours with --cuda-context"
            )
    notes += _library_notes(settings, has_convolutions)
    if settings.optimizer in ("adam8bit", "paged-adam8bit"):
        notes.append("adam8bit: bitsandbytes' state layout (uint8 moments + blockwise absmax), in-place update")
    if paged_bytes:
        notes.append(
            f"paged-adam8bit: {format_bytes(paged_bytes)} of its state (the moments of parameters of 100,000 "
            "elements or more) is CUDA unified memory outside torch's allocator, in none of these figures: nvidia-smi "
            "shows it while it is on the GPU, and the driver moves it to host memory when the GPU runs short"
        )
    if settings.quantize is not None:
        notes.append(_quantize_note(settings))
    if settings.parallel == "ddp":
        notes.append(
            f"one rank of {settings.world_size}: torch's DistributedDataParallel traced on a fake process group, its "
            "gradient buckets (every trainable gradient once more) included; every micro-batch all-reduces (no "
            "no_sync())"
        )
    if settings.parallel == "zero1" and settings.deepspeed_stage is None:
        notes.append(
            f"one rank of {settings.world_size}: torch's DistributedDataParallel and ZeroRedundancyOptimizer traced "
            "on a fake process group; the optimizer state is this rank's share of the parameters (whole parameters, "
            "largest first, to the rank with the fewest elements so far), every gradient and DDP's gradient buckets "
            "whole; DeepSpeed's ZeRO-1 partitions and buckets differ: give its configuration with --deepspeed to "
            "trace DeepSpeed's stage 1 instead"
        )
    if settings.parallel in FSDP_MODES:
        resharding = settings.parallel in RESHARDING_FSDP_MODES
        reshard = "after each forward and backward" if resharding else "after each backward only"
        notes.append(
            f"one rank of {settings.world_size}: torch's FSDP2 (fully_shard on each repeated block, then the root) "
            f"traced on a fake process group; parameters, gradients and optimizer state sharded, each module's "
            f"parameters all-gathered before its forward and backward and resharded {reshard}; its collectives' "
            "buffers allocated on their own CUDA streams, as FSDP2 does"
        )
    if settings.offload == "params" and settings.parallel in FSDP_MODES:
        pinned = (
            "pinned (torch's CachingHostAllocator rounds each up to a power of two)"
            if settings.device == "cuda"
            else "unpinned"
        )
        notes.append(
            "--offload params: FSDP2's CPUOffloadPolicy; the parameter shards, their gradients and the optimizer "
            f"state live in host memory ({pinned}) and the optimizer step runs there; each module's shards are "
            "copied to the GPU for its all-gather and each reduced gradient copied back; host_peak_bytes counts the "
            "host's share, the other figures the GPU's"
        )
    replaced = []
    if settings.deepspeed_stage is not None:
        job = (settings.batch_size, settings.grad_accum, settings.world_size, settings.optimizer)
        replaced = replaced_values(settings.deepspeed_settings, *job)
    if replaced:
        notes.append(
            "the DeepSpeed configuration's own values replaced by memplan's options (what the Trainer fills for "
            f'"auto"): {"; ".join(replaced)}'
        )
    if settings.deepspeed_stage is not None and settings.offloads_to_host:
        from memplan.distributed.deepspeed_config import runs_deepspeed_cpu_adam

        pinned = "pinned where its pin_memory says so: torch rounds each pinned buffer up to a power of two"
        if runs_deepspeed_cpu_adam(settings.deepspeed_settings):
            stepper = (
                "DeepSpeedCPUAdam, as DeepSpeed requires with offload and accelerate (so the Trainer) arranges "
                f"whatever the optimizer (here --optimizer {settings.optimizer}): two float32 moments, and a step "
                "that makes no temporaries (zero_force_ds_cpu_optimizer: false in --deepspeed runs yours instead)"
            )
        else:
            stepper = (
                f"--optimizer {settings.optimizer} itself, as zero_force_ds_cpu_optimizer: false lets DeepSpeed run "
                "a client optimizer there (torch's for-loop implementation on host tensors)"
            )
        # The model's own dtype: DeepSpeed's bf16 and fp16 make it 16-bit, fp32 and torch_autocast leave it float32.
        partition = "16-bit" if settings.precision in ("bf16", "fp16") else "float32"
        notes.append(
            "DeepSpeed's offload_optimizer: the float32 master partition, its gradient, the optimizer state and "
            f"DeepSpeed's staging buffers live in host memory ({pinned if settings.device == 'cuda' else 'unpinned'}), "
            "and the gradient norm and the step run there, the step as "
            f"{stepper}; each reduced gradient is copied to the host in the backward and the updated {partition} "
            "partition back after the step; host_peak_bytes counts the host's share, the other figures the GPU's"
        )
        if settings.deepspeed_offloads_parameters:
            notes.append(
                f"DeepSpeed's offload_param: ZeRO-3's {partition} parameter partitions live in host memory too, and "
                "each module's are copied to the GPU to be all-gathered before its forward and its backward"
            )
    band = settings.communicator_band_bytes
    if band is not None:
        notes.append(_nccl_note(settings, *band))
    return notes


def _nccl_note(settings: TrainingSettings, low: int, high: int) -> str:
    """What the device figure counts for NCCL (memplan.distributed.nccl)."""
    if settings.nccl_memory is not None:
        return f"NCCL: {format_bytes(settings.nccl_memory)} (--nccl-memory) counted in the device figure and fits"
    if high == 0:  # one rank (memplan.distributed.nccl sizes no channel buffers without a peer)
        return "NCCL: a job of one rank has no peer to exchange with, so no NCCL buffers are counted"
    variables = [
        f"{name}={value}"
        for name, value, default in (
            ("NCCL_BUFFSIZE", settings.nccl_buffsize, None),
            ("NCCL_MAX_CTAS", settings.nccl_max_ctas, None),
            ("NCCL_NVLS_ENABLE", int(settings.nccl_nvls), 1),
        )
        if value != default
    ]
    return (
        f"NCCL's communicator holds {format_bytes(low)} to {format_bytes(high)} on the GPU outside torch's allocator "
        + (f"with {', '.join(variables)} " if variables else "")
        + "(modelled from NCCL's buffer sizes, not traced: the channels and algorithms NCCL picks depend on the "
        f"machine); the device figure and fits count the top, {format_bytes(high)}: give yours with --nccl-memory"
    )


def _quantize_note(settings: TrainingSettings) -> str:
    """What --quantize counts (memplan.finetune.quantize, memplan.finetune.bnb_kernels)."""
    on_cuda = settings.device == "cuda"
    if settings.quantize == INT8:
        if not on_cuda:
            how = "each 8-bit matmul dequantizes its weight, as bitsandbytes does when training on the CPU"
        else:
            how = (
                "each 8-bit matmul quantizes its input to int8 and multiplies in int32, as bitsandbytes does on CUDA, "
                f"with {OUTLIER_COLUMN_FRACTION:.0%} of its input columns assumed to hold an outlier and multiplied "
                "in 16 bits (how many do depends on the data)"
            )
        return (
            "int8: LLM.int8()'s layout (an int8 weight and a float32 scale per row) on every linear layer but the "
            f"LM head; {how}; the weight is dequantized in the backward"
        )
    return (
        f"{settings.quantize}: bitsandbytes' 4-bit layout (double-quantized, blocks of 64) on every linear layer "
        "but the LM head; each 4-bit matmul is counted with the whole weight dequantized, as bitsandbytes does on "
        "the CPU, in the backward, and on CUDA above 1536 rows"
        + (" (with fewer rows CUDA may pick its fused kernel, which does not: then less)" if on_cuda else "")
    )


def _library_notes(settings: TrainingSettings, has_convolutions: bool) -> list[str]:
    """What the CUDA library switches mean for these numbers (memplan.estimator.cuda.cudnn, .cublas)."""
    from memplan.estimator.cuda.cublas import DETERMINISTIC_CONFIGS

    notes = []
    if settings.device != "cuda":
        return notes
    if settings.cudnn_benchmark and has_convolutions:
        notes.append(
            "cudnn.benchmark: the first iteration times each convolution's candidate plans on one workspace as large "
            "as free memory allows, then empties the allocator's cache; it cannot make the step fail, but "
            "max_memory_reserved and nvidia-smi over the run may show up to the GPU's free memory then. The "
            "steady-state figures here do not count it"
        )
    if settings.deterministic and settings.cublas_workspace_config not in DETERMINISTIC_CONFIGS:
        notes.append(
            "deterministic algorithms on CUDA need CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8, or torch raises at the "
            "first matmul (unless warn_only); memplan counted "
            + (f"{settings.cublas_workspace_config}" if settings.cublas_workspace_config else "the default workspace")
            + ": give the value your run sets with --cublas-workspace-config"
        )
    if settings.cuda_alloc_conf is not None:
        from memplan.estimator.cuda.allocator import parse_alloc_conf

        config, unmodelled = parse_alloc_conf(settings.cuda_alloc_conf)
        if config.expandable_segments:
            notes.append("expandable_segments:True: reserved_peak_bytes follows the allocator's expandable segments")
        fraction = config.per_process_memory_fraction
        if fraction is not None:
            notes.append(
                f"per_process_memory_fraction:{fraction:g}: torch's allocator is capped at that share of the card's "
                "memory; "
                + (
                    f"fits and the largest batch are judged against it on the {settings.gpu}"
                    if settings.gpu is not None
                    else "give --gpu to have fits judged against the card's share (a --budget is taken as given)"
                )
            )
        if config.garbage_collection_threshold is not None:
            notes.append(
                "garbage_collection_threshold: frees cached blocks once the allocator's use passes that share of "
                "its cap (CUDACachingAllocator.cpp garbage_collect_cached_blocks), which memplan does not model: it "
                "can only lower reserved_peak_bytes"
                if fraction is not None
                else "garbage_collection_threshold: acts only where the process caps itself with "
                "torch.cuda.set_per_process_memory_fraction (CUDACachingAllocator.cpp malloc), which this step does "
                "not; it changes nothing here"
            )
        if unmodelled:
            notes.append(
                f"PYTORCH_CUDA_ALLOC_CONF {', '.join(unmodelled)}: not modelled; reserved_peak_bytes follows the "
                "allocator's default rules for them"
            )
    if settings.cudnn_workspace_cap_mib is not None and has_convolutions:
        notes.append(
            f"CUDNN_CONV_WSCAP_DBG={settings.cudnn_workspace_cap_mib}: each convolution's workspace band is capped at "
            f"{settings.cudnn_workspace_cap_mib} MiB (a cuDNN variable NVIDIA does not document; read as MiB per call)"
        )
    return notes


def unchecked_blocks_notes(settings: TrainingSettings, checkpointed_blocks: list[str] | tuple[str, ...]) -> list[str]:
    """--checkpoint all or selective over a model they found no blocks in: said, as the header and the figures
    would otherwise read as a checkpointed step (memplan.estimator.checkpointing.repeated_block_lists)."""
    if settings.checkpoint not in ("all", "selective") or checkpointed_blocks:
        return []
    return [
        f"--checkpoint {settings.checkpoint} found no repeated blocks in this model (two or more of one class in an "
        "nn.ModuleList, or composite ones in an nn.Sequential), so nothing is checkpointed (name other modules with "
        "`memplan plan --candidates REGEX`)"
    ]


def value_dependent_kernel_notes(graph: Any) -> list[str]:
    """What the step's ops hold inside their kernels by their values, which a fake tensor has not, so that memplan
    counts the top (memplan.estimator.composite_kernels.matrix_exp)."""
    matrix_exp = torch.ops.aten.linalg_matrix_exp.default
    if not any(node.op == "call_function" and node.target == matrix_exp for node in graph.nodes):
        return []
    return [
        "linalg.matrix_exp (nn.utils.parametrizations.orthogonal's default map, and its gradient's exponential of a "
        "[2n, 2n] block matrix): the temporaries its kernel holds follow each matrix's norm (the Taylor degree it "
        "picks, 4 to 12 matrices' worth for one matrix), which memplan cannot know: the top of that range is counted; "
        "a run whose matrices have small norms peaks lower"
    ]


def onednn_convolution_notes(graph: Any, settings: TrainingSettings) -> list[str]:
    """On the cpu target: the step's convolutions that oneDNN runs in this process (composite_kernels.convolution's
    mkldnn_runs, torch.backends.mkldnn's switch as memplan's process has it), whose copies inside the kernel memplan
    does not count (docs/usage.md, "peak_bytes")."""
    if settings.device != "cpu":
        return []
    from memplan.estimator.composite_kernels.convolution import mkldnn_runs

    convolution = torch.ops.aten.convolution.default
    run = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target != convolution:
            continue
        input, weight, _, stride, _, dilation, _, _, groups = node.args[:9]
        input, weight = input.meta.get("val"), weight.meta.get("val")
        if (
            input is not None
            and weight is not None
            and mkldnn_runs(input, weight, list(stride), list(dilation), groups)
        ):
            run += 1
    if not run:
        return []
    return [
        f"oneDNN runs {run} of the step's convolution calls (recomputed ones included) on this CPU: what it holds "
        "inside them (their inputs, outputs and weights reordered to its blocked layouts, its scratchpad) is not "
        "counted, and a real CPU step holds more (a depthwise-and-pointwise conv net 29-35% more than the figure: "
        "python benchmarks/cpu_onednn_convolutions.py); with torch.backends.mkldnn off, in the run and in memplan's "
        "process, memplan models the backends that run instead"
    ]
