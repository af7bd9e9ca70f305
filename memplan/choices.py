"""Checks shared by the settings' validations: one of a tuple of choices, a positive count, options given."""

from __future__ import annotations

from typing import Any

from memplan.errors import SettingsError

# The largest batch size (and accumulation count) memplan models: the batch search's own limit
# (memplan.estimator.search.MAX_BATCH_SIZE); beyond it tensor sizes overflow inside torch.
MAX_COUNT = 1 << 20


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SettingsError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def options_given(*options: tuple[str, Any, Any]) -> list[str]:
    """The names of the (name, value, default) options whose value is not their default."""
    return [name for name, value, default in options if value != default]


def check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise SettingsError(f"{name} must be a positive integer, got {value!r}")
