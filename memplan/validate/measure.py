"""Measure one steady-state iteration for real, in this process (the worker calls this).

CUDA: the model is built on the GPU with random weights in the dtype they train in
(built_in_storage_dtype), `warmup` iterations of the canonical loop
run, peak statistics are reset, and one more iteration is measured with
torch.cuda.max_memory_allocated / max_memory_reserved and mem_get_info (device-level use, which
includes the CUDA context). CPU: the live-storage counter of memplan.measure.cpu.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import MeasurementError
from memplan.estimator.loop import STORAGE_DTYPES, iteration, prepare
from memplan.measure.collector import collector_held
from memplan.measure.cpu import measure_cpu
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings

NO_CUDA_MESSAGE = (
    "no CUDA device here, so --device cuda cannot be measured; run validate on a machine with a GPU, "
    "or validate the CPU prediction with --device cpu"
)

# Enough history for one iteration of a large model; memory_viz reads the ring buffer.
SNAPSHOT_MAX_ENTRIES = 1_000_000


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def built_in_storage_dtype(spec: ModelSpec) -> ModelSpec:
    """The same model, its weights made directly in the dtype they train in (bf16 or fp16 for those
    precisions), as `from_pretrained(..., dtype=...)` and `model.to(device, dtype)` bring weights to
    the GPU, and as memplan predicts: the weights arrive in their storage dtype, first.

    Built in float32 on the GPU and cast afterwards (`model.cuda().bfloat16()`, what this harness did
    until 2026-11-25), the float32 weights' freed blocks stay cached and the iterations lay out their
    segments in them: replayed that way, the H100's bf16 rows come within 1.3% where memplan's
    prediction was 0.4-4.4% low (docs/validation.md, "How the weights reached the GPU")."""

    def build(settings: TrainingSettings) -> torch.nn.Module:
        with _default_dtype(STORAGE_DTYPES[settings.precision]):
            return spec.build(settings)

    return replace(spec, build=build)


@dataclass(frozen=True)
class Measurement:
    device: str
    peak_bytes: int | None  # max_memory_allocated, or the CPU live-storage peak; at failure on OOM
    reserved_bytes: int | None = None  # max_memory_reserved (cuda)
    device_used_bytes: int | None = None  # total - free from cudaMemGetInfo: what nvidia-smi shows
    device_name: str = "cpu"
    torch_version: str = torch.__version__
    out_of_memory: bool = False
    message: str | None = None
    seconds: float = 0.0
    # cuda: the steady-state iteration's wall time (the last warm-up, synchronized), the attention
    # kernels a further iteration ran (aten ops whose name says attention: the SDPA backend torch
    # chose), and the software it ran on.
    step_seconds: float | None = None
    attention_ops: tuple[str, ...] = ()
    cuda_version: str | None = None
    cudnn_version: int | None = None


class _AttentionOps(TorchDispatchMode):
    """Notes the attention kernels an iteration dispatches (allocates nothing itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.name()
        if "attention" in name:
            self.seen.add(name.split("::", 1)[-1])
        return func(*args, **(kwargs or {}))


def measure(
    spec: ModelSpec,
    settings: TrainingSettings,
    *,
    warmup: int,
    snapshot: str | None = None,
    capacity_bytes: int | None = None,
    allocator_trace: str | None = None,
) -> Measurement:
    """One steady-state iteration measured; cuda: optionally under a cap of `capacity_bytes` for
    torch (set_per_process_memory_fraction), and with the measured iteration's allocator events
    written to `allocator_trace` as JSON (action, address, size, stream; no stacks)."""
    started = time.perf_counter()
    if settings.device == "cpu":
        result = measure_cpu(spec, settings, warmup_iterations=warmup)
        return Measurement(device="cpu", peak_bytes=result.peak_bytes, seconds=time.perf_counter() - started)
    if not torch.cuda.is_available():
        raise MeasurementError(NO_CUDA_MESSAGE)
    return _measure_cuda(spec, settings, warmup, snapshot, started, capacity_bytes, allocator_trace)


def configure_cuda_libraries(settings: TrainingSettings) -> None:
    """Set the run's CUDA library switches as the prediction assumed them, before CUDA starts.

    The environment variables are set or removed to match the settings exactly (an inherited
    CUBLAS_WORKSPACE_CONFIG the prediction did not count would make the two runs differ). The allocator's
    configuration goes in PYTORCH_CUDA_ALLOC_CONF alone: torch 2.11+ reads PYTORCH_ALLOC_CONF where that
    is unset (c10/cuda/CUDAAllocatorConfig.h, instance()), so an inherited one is removed.
    """
    for variable, value in (
        ("CUBLAS_WORKSPACE_CONFIG", settings.cublas_workspace_config),
        ("CUDNN_CONV_WSCAP_DBG", settings.cudnn_workspace_cap_mib),
        ("PYTORCH_CUDA_ALLOC_CONF", settings.cuda_alloc_conf),  # read when the allocator starts
        ("PYTORCH_ALLOC_CONF", None),
    ):
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = str(value)
    torch.backends.cudnn.benchmark = settings.cudnn_benchmark
    torch.backends.cudnn.allow_tf32 = settings.cudnn_allow_tf32
    torch.use_deterministic_algorithms(settings.deterministic)


def _cap_memory(capacity_bytes: int) -> None:
    """Let torch's caching allocator hold at most `capacity_bytes` (what a smaller card leaves it)."""
    _, total = torch.cuda.mem_get_info()
    if capacity_bytes > total:
        raise MeasurementError(f"cannot cap at {capacity_bytes} bytes: the GPU has {total}")
    torch.cuda.set_per_process_memory_fraction(capacity_bytes / total)


def _trace_entries() -> list[dict]:
    return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]


def _write_allocator_trace(path: str, measured_from: int) -> None:
    """Every allocator event of the run (model built, warm-ups, the measured iteration from event
    `measured_from` on) and the segments at its end, without stacks: what the warm-ups laid out is
    what the measured iteration's reserved peak depends on."""
    snapshot = torch.cuda.memory._snapshot()
    entries = snapshot["device_traces"][torch.cuda.current_device()]
    events = [[entry["action"], entry["addr"], entry["size"], entry["stream"]] for entry in entries]
    segments = [
        [segment["total_size"], segment["allocated_size"], segment["stream"]] for segment in snapshot["segments"]
    ]
    with open(path, "w") as file:
        json.dump(
            {
                "events": events[measured_from:],
                "run_events": events,
                "measured_from": measured_from,
                "segments": segments,
            },
            file,
        )


def _measure_cuda(
    spec: ModelSpec,
    settings: TrainingSettings,
    warmup: int,
    snapshot: str | None,
    started: float,
    capacity_bytes: int | None = None,
    allocator_trace: str | None = None,
) -> Measurement:
    configure_cuda_libraries(settings)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    if capacity_bytes is not None:
        _cap_memory(capacity_bytes)
    versions = {
        "device_name": name,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
    }
    attention = _AttentionOps()
    step_seconds = None
    measured_from = 0
    if allocator_trace is not None and snapshot is None:  # from the start: the warm-ups lay out the segments
        torch.cuda.memory._record_memory_history(context=None, max_entries=SNAPSHOT_MAX_ENTRIES)
    try:
        with torch.device("cuda"):
            state = prepare(built_in_storage_dtype(spec), settings)
        state.autocast_device = "cuda"
        for _ in range(warmup):
            torch.cuda.synchronize()
            step_started = time.perf_counter()
            iteration(state)
            torch.cuda.synchronize()
            step_seconds = time.perf_counter() - step_started
        with collector_held():
            torch.cuda.reset_peak_memory_stats()
            if snapshot is not None:
                torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)
            elif allocator_trace is not None:
                measured_from = len(_trace_entries())
            iteration(state)
            torch.cuda.synchronize()
        if snapshot is not None:
            torch.cuda.memory._dump_snapshot(snapshot)
        if allocator_trace is not None and snapshot is None:
            _write_allocator_trace(allocator_trace, measured_from)
        if snapshot is not None or allocator_trace is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
    except torch.OutOfMemoryError as error:
        return Measurement(
            device="cuda",
            peak_bytes=torch.cuda.max_memory_allocated(),
            reserved_bytes=torch.cuda.max_memory_reserved(),
            out_of_memory=True,
            message=str(error).splitlines()[0],
            seconds=time.perf_counter() - started,
            step_seconds=step_seconds,
            attention_ops=tuple(sorted(attention.seen)),
            **versions,
        )
    free, total = torch.cuda.mem_get_info()
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    seconds = time.perf_counter() - started
    # Which attention kernels ran, from one more iteration after everything is read: under a Python
    # dispatch mode the autograd engine adds gradients out of place and tensors are held
    # differently, so an iteration under one must not lay out the segments the measurement reads.
    try:
        with attention:
            iteration(state)
    except torch.OutOfMemoryError:
        pass  # the measurement stands; only the kernel names are missing
    return Measurement(
        device="cuda",
        peak_bytes=peak,
        reserved_bytes=reserved,
        device_used_bytes=total - free,
        seconds=seconds,
        step_seconds=step_seconds,
        attention_ops=tuple(sorted(attention.seen)),
        **versions,
    )
