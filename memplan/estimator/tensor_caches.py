"""The lru caches transformers' models keep tensors in, emptied for each fake run and given back after it.

transformers decorates functions that build a tensor from Python numbers with `compile_compatible_method_lru_cache`
(transformers/pytorch_utils.py): an `functools.lru_cache` held in the wrapper's closure (`func_with_cache`), one per
function for the whole process. BEiT's and Data2VecVision's `generate_relative_position_index(window_size)`
(modeling_beit.py, modeling_data2vec_vision.py), DETR's and SAM's sine position embeddings, RT-DETR's anchors are
such functions. Under fake tensors that cache crossed between memplan's run and the user's:
- an estimate left a fake tensor in it, and the user's real BEiT, trained afterwards in the same process, indexed its
  bias table with it: its loss came out a FakeTensor, with no error (a helper's hunt, 2026-12-07);
- a real run before the estimate left a real tensor in it, which the trace read as a constant the step did not make,
  and a later estimate read the earlier one's fake tensor, made under another fake mode.

Each fake run here (memplan.estimator.trace: the setup's untraced runs, each traced step) finds every such cache of
the transformers modules imported so far empty, as a fresh process's first iteration does, and the user's caches are
put back as they were when it ends. The tensors the step puts in a cache stay there in a real run, for the rest of the
process: `cached_tensors()` names them, and the trace keeps them to the step's end, as it keeps tensors the model
holds on its modules (memplan.estimator.module_attributes; a checkpointed BEiT's step was 0.5% low without it, the
index freed after the backward's last read of it while the real run holds it through the optimizer step).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import CellType, FunctionType, ModuleType
from typing import Any, ParamSpec, TypeVar

import torch

from memplan.estimator.model_modules import found_in_model_modules
from memplan.estimator.python_locals import tensors_held

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class _Run:
    """One fake run's caches: the cells it swapped, with the caches they held before, and what its caches computed."""

    swapped: dict[int, tuple[CellType, Any]] = field(default_factory=dict)
    results: list[Any] = field(default_factory=list)


_ACTIVE: list[_Run] = []  # innermost run last


def _wrapper_code() -> Any:
    """The code object every `compile_compatible_method_lru_cache` wrapper shares; None where transformers (or that
    decorator) is not imported."""
    utils = sys.modules.get("transformers.pytorch_utils")
    decorator = getattr(utils, "compile_compatible_method_lru_cache", None)
    if decorator is None:
        return None
    code = decorator()(lambda: None).__code__
    return code if "func_with_cache" in code.co_freevars else None


def _cache_cells() -> list[CellType]:
    """The closure cells holding the lru caches of the wrappers that transformers' imported modeling modules define,
    as module functions or as (static) methods of their classes (each module read once:
    memplan.estimator.model_modules)."""
    if _wrapper_code() is None:
        return []
    cells = {id(cell): cell for cell in found_in_model_modules(_module_cache_cells)}
    return list(cells.values())


def _module_cache_cells(name: str, module: ModuleType) -> list[CellType]:
    """The cache cells of the wrappers one modeling module defines (_cache_cells)."""
    code = _wrapper_code()
    index = code.co_freevars.index("func_with_cache")
    values = list(vars(module).values())
    for value in list(values):
        if isinstance(value, type) and value.__module__ == name:
            values.extend(vars(value).values())
    cells = []
    for value in values:
        function = value.__func__ if isinstance(value, staticmethod | classmethod) else value
        if isinstance(function, FunctionType) and function.__code__ is code and function.__closure__:
            cells.append(function.__closure__[index])
    return cells


def _recorded(function: Callable[..., Any], results: list[Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        results.append(result)
        return result

    return run


@contextlib.contextmanager
def fresh_tensor_caches() -> Iterator[None]:
    """Every cache `_cache_cells` finds replaced by an empty one of the same size for the duration (and those of
    modules imported meanwhile, where `caches_of_new_modules` is called); the old ones back after it, whatever the run
    put in the new ones dropped with them."""
    run = _Run()
    _ACTIVE.append(run)
    try:
        caches_of_new_modules()
        yield
    finally:
        _ACTIVE.pop()
        for cell, cache in reversed(run.swapped.values()):
            cell.cell_contents = cache


def caches_of_new_modules() -> None:
    """Inside fresh_tensor_caches: swap the caches of the modules imported since it began, too. Called where a model
    has just been built (transformers imports a model's module when it first builds one), before its first forward."""
    if not _ACTIVE:
        return
    run = _ACTIVE[-1]
    for cell in _cache_cells():
        if id(cell) in run.swapped:
            continue
        cache = cell.cell_contents
        parameters = cache.cache_parameters() if hasattr(cache, "cache_parameters") else {"maxsize": 128}
        run.swapped[id(cell)] = (cell, cache)
        cell.cell_contents = functools.lru_cache(**parameters)(_recorded(cache.__wrapped__, run.results))


def run_with_fresh_tensor_caches(function: Callable[P, R]) -> Callable[P, R]:
    """`function` run inside fresh_tensor_caches."""

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with fresh_tensor_caches():
            return function(*args, **kwargs)

    return run


def cached_tensors() -> list[torch.Tensor]:
    """The tensors the innermost fresh_tensor_caches run has put in the caches so far (none outside one)."""
    return [tensor for result in (_ACTIVE[-1].results if _ACTIVE else []) for tensor in tensors_held(result)]
