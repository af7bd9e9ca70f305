"""What memplan finds in the transformers modeling modules a process has imported, each module read again only where
something in it changed.

Two of memplan's patches look for objects every imported `transformers.models.*` module defines: the lru caches of
tensors (memplan.estimator.tensor_caches) and the rotary embeddings' frequency updates (memplan.estimator.hf_patches).
They looked at each trace, walking every such module's namespace and its classes' namespaces again: in a process that
has imported many model families (a test worker, a notebook that tried several models) that walk was 6-7% of a trace's
time (py-spy over the whole test suite, 2026-12-07: 5.9% in tensor_caches' walk, 1.2% in hf_patches').

A finder's answer for a module is kept with what the module's namespace and the namespaces of the classes it defines
held when it was read, and the module is read again where any of them holds another object (a class or a static
method a library rebinds after import: a review replaced DETR's cached sine embedding and found the new cache missed)
or it is another module object under its name. The comparison is by identity, over the values themselves, kept here
(not over their ids, which a replaced object's successor may take): a pass over the names in C, no walk in Python.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")


class _Read:
    """One finder's answer for one module, with what the module (and each class it defines) held when it was read."""

    __slots__ = ("classes", "found", "module", "values")

    def __init__(self, module: ModuleType, found: list[Any]) -> None:
        self.module = module
        self.values = tuple(vars(module).values())
        name = module.__name__
        self.classes = [
            (value, tuple(vars(value).values()))
            for value in self.values
            if isinstance(value, type) and value.__module__ == name
        ]
        self.found = found

    def still_current(self, module: ModuleType) -> bool:
        return (
            module is self.module
            and _same_objects(tuple(vars(module).values()), self.values)
            and all(_same_objects(tuple(vars(cls).values()), held) for cls, held in self.classes)
        )


def _same_objects(now: tuple[Any, ...], then: tuple[Any, ...]) -> bool:
    return len(now) == len(then) and all(map(operator.is_, now, then))


# finder -> module name -> what it found there, and when
_FOUND: dict[Callable[[str, ModuleType], list], dict[str, _Read]] = {}


def found_in_model_modules(finder: Callable[[str, ModuleType], list[T]]) -> list[T]:
    """What `finder(name, module)` finds in each imported transformers modeling module, in sys.modules' order; a
    module's answer kept from the last call where its namespace and its classes' hold the same objects."""
    known = _FOUND.setdefault(finder, {})
    found: list[T] = []
    present = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        present += 1
        read = known.get(name)
        if read is None or not read.still_current(module):
            read = known[name] = _Read(module, finder(name, module))
        found.extend(read.found)
    if len(known) > present:  # a module gone from sys.modules: what was read of it (and what it held) is let go too
        for name in [name for name in known if sys.modules.get(name) is None]:
            del known[name]
    return found
