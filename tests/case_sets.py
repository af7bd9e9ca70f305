"""Measured cases split between the default run and the extended set (docs/testing.md, "Extended cases")."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import pytest


def with_extended(cases: Sequence[Any], extended: Collection[Any]) -> list[Any]:
    """`cases` for `pytest.mark.parametrize`, those in `extended` marked `extended`: left out of the default run
    (pyproject.toml's addopts, `-m "not extended"`), which keeps one or two cases a family and each path (precision,
    checkpointing, attention); `python -m pytest -m extended` runs the rest."""
    unknown = [case for case in extended if case not in cases]
    assert not unknown, f"extended cases that are not cases: {unknown}"
    return [pytest.param(case, marks=pytest.mark.extended) if case in extended else case for case in cases]
