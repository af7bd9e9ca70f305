"""Measure one steady-state iteration for real, in this process (the worker calls this).

CUDA: the model is built on the GPU with random weights, `warmup` iterations of the canonical loop
run, peak statistics are reset, and one more iteration is measured with
torch.cuda.max_memory_allocated / max_memory_reserved and mem_get_info (device-level use, which
includes the CUDA context). CPU: the live-storage counter of memplan.measure.cpu.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from memplan.errors import MeasurementError
from memplan.estimator.loop import iteration, prepare
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


def measure(spec: ModelSpec, settings: TrainingSettings, *, warmup: int, snapshot: str | None = None) -> Measurement:
    started = time.perf_counter()
    if settings.device == "cpu":
        result = measure_cpu(spec, settings, warmup_iterations=warmup)
        return Measurement(device="cpu", peak_bytes=result.peak_bytes, seconds=time.perf_counter() - started)
    if not torch.cuda.is_available():
        raise MeasurementError(NO_CUDA_MESSAGE)
    return _measure_cuda(spec, settings, warmup, snapshot, started)


def configure_cuda_libraries(settings: TrainingSettings) -> None:
    """Set the run's CUDA library switches as the prediction assumed them, before CUDA starts.

    The environment variables are set or removed to match the settings exactly (an inherited
    CUBLAS_WORKSPACE_CONFIG the prediction did not count would make the two runs differ).
    """
    for variable, value in (
        ("CUBLAS_WORKSPACE_CONFIG", settings.cublas_workspace_config),
        ("CUDNN_CONV_WSCAP_DBG", settings.cudnn_workspace_cap_mib),
        ("PYTORCH_CUDA_ALLOC_CONF", settings.cuda_alloc_conf),  # read when the allocator starts
    ):
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = str(value)
    torch.backends.cudnn.benchmark = settings.cudnn_benchmark
    torch.backends.cudnn.allow_tf32 = settings.cudnn_allow_tf32
    torch.use_deterministic_algorithms(settings.deterministic)


def _measure_cuda(
    spec: ModelSpec, settings: TrainingSettings, warmup: int, snapshot: str | None, started: float
) -> Measurement:
    configure_cuda_libraries(settings)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    try:
        with torch.device("cuda"):
            state = prepare(spec, settings)
        state.autocast_device = "cuda"
        for _ in range(warmup):
            iteration(state)
        torch.cuda.synchronize()
        with collector_held():
            torch.cuda.reset_peak_memory_stats()
            if snapshot is not None:
                torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)
            iteration(state)
            torch.cuda.synchronize()
        if snapshot is not None:
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
    except torch.OutOfMemoryError as error:
        return Measurement(
            device="cuda",
            peak_bytes=torch.cuda.max_memory_allocated(),
            reserved_bytes=torch.cuda.max_memory_reserved(),
            device_name=name,
            out_of_memory=True,
            message=str(error).splitlines()[0],
            seconds=time.perf_counter() - started,
        )
    free, total = torch.cuda.mem_get_info()
    return Measurement(
        device="cuda",
        peak_bytes=torch.cuda.max_memory_allocated(),
        reserved_bytes=torch.cuda.max_memory_reserved(),
        device_used_bytes=total - free,
        device_name=name,
        seconds=time.perf_counter() - started,
    )
