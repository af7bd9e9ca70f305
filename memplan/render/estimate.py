"""Render an EstimateResult as a rich table or JSON; the estimator itself never prints."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from memplan.advice import when_nothing_fits
from memplan.checkpoint_layout import CheckpointLayout
from memplan.choices import MAX_COUNT
from memplan.distributed.modes import FSDP_MODES
from memplan.estimator.result import EstimateResult
from memplan.gpus import DEFAULT_GPU
from memplan.render.units import format_flops, format_seconds
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes

_CATEGORY_LABELS = {
    "parameters": "parameters (+ buffers)",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations saved for backward",
    "temporaries": "temporaries",
    "inputs": "inputs (micro-batch)",
    "workspaces": "cuBLAS / cuDNN workspaces",
    "communication": "DDP gradient buckets",
    "unsharded_parameters": "unsharded parameters (all-gathered)",
}
# Under FSDP2 the communication line is its collectives' flat buffers.
_FSDP_COMMUNICATION_LABEL = "all-gather / reduce-scatter buffers"
# Under DeepSpeed's ZeRO-2, the buckets its gradients are copied into to be reduced.
_DEEPSPEED_COMMUNICATION_LABEL = "DeepSpeed reduce buckets"


def to_json(result: EstimateResult) -> str:
    return json.dumps(result.to_dict(), indent=2)


def describe_settings(s: TrainingSettings, with_batch: bool = True) -> str:
    shape = f"seq {s.seq_len}" if s.seq_len else f"image {s.image_size}²" if s.image_size else ""
    if s.target_len and s.target_len != s.seq_len:
        shape += f", target {s.target_len}"
    parts = [
        f"batch {s.batch_size}" if with_batch else "",
        shape,
        f"grad-accum {s.grad_accum}" if s.grad_accum > 1 else "",
        s.precision,
        _describe_lora(s),
        s.optimizer if s.optimizer_impl == "default" else f"{s.optimizer} ({s.optimizer_impl})",
        _describe_checkpoint(s.checkpoint),
        f"{s.loop} loop" if s.loop != "canonical" else "",
        f"--step {s.step}" if s.step else "",
        f"target {s.device}" + (f" ({s.gpu})" if s.gpu else ""),
        "eager attention" if s.attn_impl == "eager" else "",
        _describe_parallel(s, with_batch),
    ]
    return ", ".join(part for part in parts if part)


def _describe_parallel(s: TrainingSettings, with_batch: bool = True) -> str:
    if s.parallel == "none":
        return ""
    rank = {
        "ddp": "DDP",
        "zero1": "ZeRO-1 (DDP, optimizer state sharded)",
        "fsdp": "FSDP2",
        "fsdp-grad-op": "FSDP2 (no reshard after forward)",
        "hsdp": f"HSDP (FSDP2 sharded over {s.shard_size}, replicated {s.world_size // (s.shard_size or 1)}×)",
        "zero2": "DeepSpeed ZeRO-2",
        "zero3": "DeepSpeed ZeRO-3",
    }[s.parallel]
    if s.deepspeed_stage == 1:
        rank = "DeepSpeed ZeRO-1"
    mixed = f", gathered in {s.fsdp_mixed_precision}" if s.fsdp_mixed_precision else ""
    if s.offload == "params" or s.deepspeed_offloads_parameters:
        mixed += ", state offloaded to the CPU"
    elif s.offloads_to_host:
        mixed += ", optimizer offloaded to the CPU"
    if not with_batch:  # a sweep or a plan's table: each row has its own micro-batch
        return f"one {rank} rank of {s.world_size}{mixed} (total batch micro-batch×{s.grad_accum}×{s.world_size})"
    total = s.batch_size * s.grad_accum * s.world_size
    return (
        f"one {rank} rank of {s.world_size}{mixed} (total batch {s.batch_size}×{s.grad_accum}×{s.world_size} = "
        f"{total:,})"
    )


def _host_contents(s: TrainingSettings) -> str:
    """What an offloading rank keeps in host memory, for the line under the table."""
    if s.deepspeed_stage is None:
        return "--offload params: shards, gradients, optimizer state and step"
    parameters = "parameter partitions, " if s.deepspeed_offloads_parameters else ""
    return f"DeepSpeed's offload: {parameters}master partition, its gradient, optimizer state, staging buffers and step"


def _describe_lora(s: TrainingSettings) -> str:
    if s.lora_rank is None:
        return ""
    details = [
        f"alpha {s.lora_alpha:g}" if s.lora_alpha is not None else "",
        f"on {s.lora_targets}" if s.lora_targets else "",
    ]
    details.append(f"dropout {s.lora_dropout:g}" if s.lora_dropout else "")
    if s.quantize is not None:
        details.append(f"on an {s.quantize}-quantized base (QLoRA)")
    return " ".join([f"LoRA r={s.lora_rank}", *(part for part in details if part)])


def _describe_checkpoint(checkpoint: str | CheckpointLayout) -> str:
    if isinstance(checkpoint, CheckpointLayout):
        return f"checkpoint plan: {checkpoint.describe()}" if checkpoint.segments else ""
    return {"all": "checkpoint all blocks", "selective": "selective checkpointing"}.get(checkpoint, "")


def render_estimate(result: EstimateResult, console: Console) -> None:
    console.print(f"[bold]{result.model}[/bold]: {describe_settings(result.settings)}")
    console.print(
        f"{result.parameter_count:,} parameters ({result.trainable_parameter_count:,} trainable)"
        + (f", {len(result.checkpointed_blocks)} blocks checkpointed" if result.checkpointed_blocks else "")
    )
    table = Table(title="memory at the peak", title_justify="left")
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    cuda = result.settings.device == "cuda"
    for key, value in result.breakdown.to_dict().items():
        if key == "workspaces" and not cuda and value == 0:
            continue  # none off cuda, save a library's own temporaries (bitsandbytes'): shown where there are some
        if key == "communication" and result.settings.parallel == "none":
            continue
        if key == "unsharded_parameters" and result.settings.parallel not in (*FSDP_MODES, "zero3"):
            continue
        share = value / result.peak_bytes if result.peak_bytes else 0.0
        label = _CATEGORY_LABELS[key] if cuda or key != "workspaces" else "workspaces"
        if key == "communication" and result.settings.parallel in FSDP_MODES:
            label = _FSDP_COMMUNICATION_LABEL
        if key == "communication" and result.settings.deepspeed_stage is not None:
            label = _DEEPSPEED_COMMUNICATION_LABEL
        table.add_row(label, format_bytes(value), f"{share:.1%}")
    table.add_row("[bold]peak[/bold] (live tensors)", f"[bold]{format_bytes(result.peak_bytes)}[/bold]", "")
    if result.allocated_peak_bytes is not None:
        table.add_row("max_memory_allocated (blocks handed out)", format_bytes(result.allocated_peak_bytes), "")
    if result.reserved_peak_bytes is not None:
        table.add_row("reserved by the caching allocator", format_bytes(result.reserved_peak_bytes), "")
    if result.device_peak_bytes is not None:
        context = format_bytes(result.settings.context_bytes)
        with_nccl = result.communicator_bytes is not None
        if with_nccl:
            given = result.settings.nccl_memory is not None
            low = format_bytes(result.communicator_low_bytes or 0)
            table.add_row(
                "NCCL buffers (--nccl-memory)" if given else f"NCCL buffers (modelled top; at least {low})",
                format_bytes(result.communicator_bytes or 0),
                "",
            )
        table.add_row(
            f"device total with {context} CUDA context{' and NCCL' if with_nccl else ''} (nvidia-smi)",
            format_bytes(result.device_peak_bytes),
            "",
        )
    console.print(table)
    if result.host_peak_bytes is not None:
        console.print(
            f"host memory ({_host_contents(result.settings)}), at its peak: "
            f"{format_bytes(result.host_peak_bytes)}, in none of the figures above"
        )
    if result.conv_workspace_free_reserved_peak_bytes is not None:
        without, top = result.conv_workspace_free_reserved_peak_bytes, result.reserved_peak_bytes or 0
        console.print(
            f"cuDNN convolution workspaces: reserved {format_bytes(top)} with those of the plans cuDNN ran on an "
            f"H100, {format_bytes(without)} with none, depending on the algorithms cuDNN picks"
            + (" (the allocator's segments fall differently: here none reserves more)" if without > top else "")
        )
    if result.smallest_device_bytes is not None:
        console.print(f"completes in {format_bytes(result.smallest_device_bytes)} for torch{_completes(result)}")
    where = f"{result.peak_op}" + (f" in {result.peak_module}" if result.peak_module else "")
    console.print(f"peak in the {result.phase} pass at {where}")
    phases = ", ".join(f"{phase} {format_bytes(value)}" for phase, value in result.phase_peak_bytes.items())
    console.print(f"peak by phase: {phases}")
    if result.per_sample_activation_bytes is not None and result.fixed_bytes is not None:
        console.print(
            f"per sample: {format_bytes(result.per_sample_activation_bytes)}; "
            f"fixed part: {format_bytes(result.fixed_bytes)}"
        )
    if result.roofline_step_seconds is not None:
        console.print(
            f"step: {format_flops(result.step_flops)}; roofline time {format_seconds(result.roofline_step_seconds)} "
            f"on {result.settings.gpu or DEFAULT_GPU} (a lower bound from datasheet peaks)"
        )
    if result.budget_bytes is not None:
        verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
        measure = (
            "the step replayed on a device of that size"
            if result.smallest_device_bytes is not None
            else "the peak compared with it"
        )
        console.print(f"budget {format_bytes(result.budget_bytes)}: {verdict} ({measure})")
        if result.max_batch_size_is_limit:
            console.print(
                f"largest batch size that fits: at least {result.max_batch_size:,} (memplan searches no further)"
            )
        elif result.max_batch_size:
            console.print(f"largest batch size that fits: {result.max_batch_size}")
        else:
            console.print(f"[red]not even batch size 1 fits[/red]: {when_nothing_fits(result, result.budget_bytes)}")
        if result.max_seq_len is not None:
            console.print(_longest_sequence(result))
    if result.unsupported_ops:
        listed = ", ".join(result.unsupported_ops)
        console.print(f"[yellow]unsupported ops (not counted unless said):[/yellow] {listed}")
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]")
    lines = (
        f" (+{result.interpolated_batch_sizes} batch sizes from lines through them)"
        if result.interpolated_batch_sizes
        else ""
    )
    console.print(
        f"[dim]{result.traces} traces{lines}, {result.graph_nodes:,} graph nodes, {result.seconds:.1f} s[/dim]"
    )


def _longest_sequence(result: EstimateResult) -> str:
    batch = result.settings.batch_size
    if not result.max_seq_len:
        return f"[red]no sequence length fits[/red] at batch size {batch}"
    if result.max_seq_len_is_limit:
        limit = "the most memplan searches" if result.max_seq_len == MAX_COUNT else "the model's own maximum"
        return f"longest sequence that fits at batch size {batch}: {result.max_seq_len:,}, {limit}"
    return f"longest sequence that fits at batch size {batch}: {result.max_seq_len:,}"


def _completes(result: EstimateResult) -> str:
    """Why the least memory the step completes in can be below the reserved peak."""
    retry = (
        ": short of memory, the allocator unmaps its free pages and retries"
        if result.settings.allocator_config.expandable_segments
        else ": short of memory, the allocator frees its cached segments and retries"
    )
    below = (result.reserved_peak_bytes or 0) > (result.smallest_device_bytes or 0)
    band = result.conv_workspace_free_reserved_peak_bytes is not None
    return (retry if below else "") + (", whichever plans cuDNN picks" if band else "")
