"""memplan.estimator.model_modules: each imported transformers modeling module is read once per finder, and read
again where it is another module under its name or has another number of names."""

from __future__ import annotations

import sys
from types import ModuleType

from memplan.estimator.model_modules import found_in_model_modules


def test_a_module_is_read_once_and_again_only_where_it_changed(monkeypatch):
    reads: list[str] = []

    def finder(name: str, module: ModuleType) -> list[str]:
        if not name.startswith("transformers.models.memplan_probe"):
            return []  # (the modeling modules this process has imported for real)
        reads.append(name)
        return [f"{name}:{value}" for key, value in vars(module).items() if key.startswith("marked")]

    first = ModuleType("transformers.models.memplan_probe_a")
    first.marked = 1
    monkeypatch.setitem(sys.modules, first.__name__, first)
    assert found_in_model_modules(finder) == [f"{first.__name__}:1"]
    assert found_in_model_modules(finder) == [f"{first.__name__}:1"]
    assert reads == [first.__name__]  # the second call read nothing

    second = ModuleType("transformers.models.memplan_probe_b")  # a family imported between two traces
    second.marked = 2
    monkeypatch.setitem(sys.modules, second.__name__, second)
    assert found_in_model_modules(finder) == [f"{first.__name__}:1", f"{second.__name__}:2"]
    assert reads == [first.__name__, second.__name__]

    first.marked_too = 3  # a name more: read again
    assert f"{first.__name__}:3" in found_in_model_modules(finder)
    reloaded = ModuleType(first.__name__)  # another module object under the name, with as many names
    for key, value in vars(first).items():
        if key.startswith("marked"):
            setattr(reloaded, key, value + 10)
    monkeypatch.setitem(sys.modules, first.__name__, reloaded)
    assert sorted(found_in_model_modules(finder)) == sorted(
        [f"{first.__name__}:11", f"{first.__name__}:13", f"{second.__name__}:2"]
    )
    assert reads == [first.__name__, second.__name__, first.__name__, first.__name__]
