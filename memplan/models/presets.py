"""Model presets shipped as config data (memplan/models/presets/*.json): no weights, no network."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str
    task: str
    hub_id: str
    config: dict[str, Any]


@cache
def all_presets() -> dict[str, Preset]:
    folder = resources.files("memplan.models") / "presets"
    presets = {}
    for entry in sorted(folder.iterdir(), key=lambda item: item.name):
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text())
            name = entry.name.removesuffix(".json")
            presets[name] = Preset(name=name, **data)
    return presets


def get_preset(name: str) -> Preset | None:
    return all_presets().get(name.lower())


def preset_for_hub_id(hub_id: str) -> Preset | None:
    """The preset whose config is that of the hub model `hub_id` (`meta-llama/Llama-3.1-8B`), if any."""
    wanted = hub_id.lower()
    return next((preset for preset in all_presets().values() if preset.hub_id.lower() == wanted), None)
