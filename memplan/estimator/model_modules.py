"""What memplan finds in the transformers modeling modules a process has imported, each module read once.

Two of memplan's patches look for objects every imported `transformers.models.*` module defines: the lru caches of
tensors (memplan.estimator.tensor_caches) and the rotary embeddings' frequency updates (memplan.estimator.hf_patches).
They looked at each trace, walking every such module's namespace and its classes' namespaces again: in a process that
has imported many model families (a test worker, a notebook that tried several models) that walk was 6-7% of a trace's
time (py-spy over the whole test suite, 2026-12-07: 5.9% in tensor_caches' walk, 1.2% in hf_patches'). A module's
definitions are made as it is imported, so each module is read once per finder, and again only where it is another
module object under the same name (reloaded) or its namespace has another number of names.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

T = TypeVar("T")

# finder -> module name -> (the module, weakly; how many names it had; what the finder found in it)
_FOUND: dict[Callable[[str, ModuleType], list], dict[str, tuple[weakref.ref, int, list]]] = {}


def found_in_model_modules(finder: Callable[[str, ModuleType], list[T]]) -> list[T]:
    """What `finder(name, module)` finds in each imported transformers modeling module, in sys.modules' order; a
    module's answer kept from the last call where it is the same module object with as many names."""
    known = _FOUND.setdefault(finder, {})
    found: list[T] = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        names = len(vars(module))
        entry = known.get(name)
        if entry is None or entry[0]() is not module or entry[1] != names:
            entry = known[name] = (weakref.ref(module), names, finder(name, module))
        found.extend(entry[2])
    return found
