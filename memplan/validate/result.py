"""The result of validating one configuration: prediction beside measurement."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


def relative_error(predicted: int | None, measured: int | None) -> float | None:
    """(predicted - measured) / measured; positive means memplan over-predicts."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


@dataclass(frozen=True)
class ValidationResult:
    model: str
    settings: dict[str, Any]
    device: str  # the target measured: cuda or cpu
    # cuda: EstimateResult.allocated_peak_bytes (max_memory_allocated, whole blocks); cpu: peak_bytes.
    # None when the prediction itself failed (see error)
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None  # None when the run failed before measuring
    predicted_reserved_bytes: int | None
    measured_reserved_bytes: int | None
    predicted_device_bytes: int | None
    measured_device_bytes: int | None
    device_name: str
    torch_version: str
    out_of_memory: bool = False
    error: str | None = None  # why there is no measurement (a crash, a timeout), or the OOM message
    predict_seconds: float = 0.0
    measure_seconds: float = 0.0
    snapshot: str | None = None

    @property
    def relative_error(self) -> float | None:
        return None if self.out_of_memory else relative_error(self.predicted_peak_bytes, self.measured_peak_bytes)

    @property
    def reserved_relative_error(self) -> float | None:
        if self.out_of_memory:
            return None
        return relative_error(self.predicted_reserved_bytes, self.measured_reserved_bytes)

    @property
    def measured(self) -> bool:
        return self.measured_peak_bytes is not None and not self.out_of_memory and self.error is None

    def to_dict(self) -> dict[str, Any]:
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["relative_error"] = self.relative_error
        data["reserved_relative_error"] = self.reserved_relative_error
        data["predict_seconds"] = round(self.predict_seconds, 3)
        data["measure_seconds"] = round(self.measure_seconds, 3)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidationResult:
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})
