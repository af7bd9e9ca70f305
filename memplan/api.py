"""The Python API: one function per job, each returning a frozen result dataclass."""

from __future__ import annotations

from typing import Any

from memplan.errors import SettingsError
from memplan.estimator.estimate import Progress, run_estimate
from memplan.estimator.result import EstimateResult
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings, parse_size


def estimate(
    model: str,
    settings: TrainingSettings | None = None,
    *,
    inputs: str | None = None,
    loss: str | None = None,
    task: str | None = None,
    budget: str | int | None = None,
    progress: Progress | None = None,
    **setting_overrides: Any,
) -> EstimateResult:
    """Predict the peak memory of one steady-state training iteration of `model`.

    `model` is a preset name, a transformers model type, a config.json or model directory, a cached
    hub id, or `package.module:callable`. Settings come from `settings` and/or keyword overrides
    (`batch_size=8, precision="amp-bf16", ...`). With `budget` ("24GiB", "80GB", bytes) the result
    says whether the configuration fits and the largest batch size that does.
    """
    unknown = set(setting_overrides) - set(TrainingSettings.__dataclass_fields__)
    if unknown:
        raise SettingsError(
            f"unknown setting(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(TrainingSettings.__dataclass_fields__)}"
        )
    settings = (settings or TrainingSettings()).replace(**setting_overrides)
    spec = resolve_model(model, inputs=inputs, loss=loss, task=task)
    budget_bytes = parse_size(budget) if budget is not None else None
    return run_estimate(spec, settings, budget_bytes=budget_bytes, progress=progress)
