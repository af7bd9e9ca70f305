"""JSON for result dataclasses: their fields, nested results through their own to_dict()."""

from __future__ import annotations

import dataclasses
from typing import Any


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple | list):
        return [_jsonable(item) for item in value]
    return value


def fields_dict(result: Any, **extra: Any) -> dict[str, Any]:
    """Every field of a result dataclass as a JSON value (tuples as lists, `seconds` to the millisecond)."""
    data = {field.name: _jsonable(getattr(result, field.name)) for field in dataclasses.fields(result)}
    if "seconds" in data:
        data["seconds"] = round(data["seconds"], 3)
    return {**data, **extra}
