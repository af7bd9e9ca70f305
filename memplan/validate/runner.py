"""Predict a configuration here, measure it in a subprocess, and put the two side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

from memplan.errors import MeasurementError, SettingsError, UsageError
from memplan.estimator.estimate import run_estimate
from memplan.models.source import ModelRef, ModelSpec
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes
from memplan.validate.measure import NO_CUDA_MESSAGE
from memplan.validate.result import ValidationResult

DEFAULT_WARMUP_ITERATIONS = 2
DEFAULT_TIMEOUT_SECONDS = 1800


def check_can_measure(device: str, snapshot: str | None = None) -> None:
    """Refuse at once, before any prediction, what cannot be measured here."""
    import torch

    if snapshot is not None and device != "cuda":
        raise UsageError("--snapshot records the CUDA caching allocator; it needs --device cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise MeasurementError(NO_CUDA_MESSAGE)


def measure_in_subprocess(
    model: ModelRef,
    settings: TrainingSettings,
    *,
    warmup: int = DEFAULT_WARMUP_ITERATIONS,
    snapshot: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_SECONDS,
) -> dict:
    """Run memplan.validate.worker on one configuration; its measurement, or {"error": ...}."""
    request = {
        "model": model.to_dict(),
        "settings": settings.to_dict(),
        "warmup": warmup,
        "snapshot": snapshot,
    }
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "memplan.validate.worker"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the measurement ran past {timeout_s:g} s and was stopped (--timeout)"}
    lines = completed.stdout.strip().splitlines()
    if lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    tail = " | ".join(completed.stderr.strip().splitlines()[-3:])
    return {"error": f"the measuring process died (exit {completed.returncode}): {tail or 'no output'}"}


def validate_config(
    spec: ModelSpec,
    settings: TrainingSettings,
    *,
    warmup: int = DEFAULT_WARMUP_ITERATIONS,
    snapshot: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_SECONDS,
    plan_fingerprint: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> ValidationResult:
    report = progress or (lambda message: None)
    if settings.offloads_to_host and settings.device != "cpu":
        # On a GPU the host's and the GPU's memory are measured apart only by the CPU validator so far (FSDP2's
        # CPUOffloadPolicy would need the model built on the host, DeepSpeed's offload its CPU Adam kernel).
        raise SettingsError("validate --offload runs on the CPU only for now: give --device cpu")
    prediction = run_estimate(spec, settings, progress=progress, plan_fingerprint=plan_fingerprint)
    report(f"measuring a real {settings.device} run")
    measured = measure_in_subprocess(
        spec.ref, prediction.settings, warmup=warmup, snapshot=snapshot, timeout_s=timeout_s
    )
    error = measured.get("error")
    out_of_memory = bool(measured.get("out_of_memory"))
    if out_of_memory:
        error = (
            f"measured: out of memory above {format_bytes(measured['peak_bytes'])}; "
            f"predicted {format_bytes(prediction.peak_bytes)} ({measured.get('message')})"
        )
    return ValidationResult(
        model=spec.name,
        settings=prediction.settings.to_dict(),
        device=settings.device,
        # cuda: what max_memory_allocated counts, the allocator's whole blocks (the live tensors elsewhere)
        predicted_peak_bytes=prediction.allocated_peak_bytes or prediction.peak_bytes,
        measured_peak_bytes=measured.get("peak_bytes"),
        predicted_reserved_bytes=prediction.reserved_peak_bytes,
        measured_reserved_bytes=measured.get("reserved_bytes"),
        # the measured rank runs on torch's fake process group: no NCCL communicator to count
        predicted_device_bytes=prediction.device_bytes_without_nccl,
        measured_device_bytes=measured.get("device_used_bytes"),
        device_name=measured.get("device_name", "unknown"),
        torch_version=measured.get("torch_version", "unknown"),
        out_of_memory=out_of_memory,
        error=error,
        predict_seconds=prediction.seconds,
        measure_seconds=measured.get("seconds", 0.0),
        snapshot=snapshot if snapshot is not None and error is None else None,
    )
