"""When storages live and die where a library swaps them under its parameters with `param.data = ...`.

memplan's liveness follows the graph: a storage the iteration starts with lives to its end, and one
an op makes lives to its last reader. A library that points parameters at other storages outside
dispatch breaks both. DeepSpeed's ZeRO-3 keeps each parameter as an empty tensor between uses,
gathers it into a new buffer before a module runs (`param.data = flat_buffer.narrow(...)`) and
drops it after (`free_param`: `param.data = torch.empty(0)`), so
- a gathered storage the iteration starts with (a persistent parameter, gathered in the previous
  step's end) is freed inside it when the step partitions every parameter (stage3.py, `step`:
  `_partition_all_parameters`), which the graph cannot see: it would count it to the end;
- a storage gathered inside the iteration and kept for the next one (the persistent parameters
  gathered again after the step, `_post_step`) is read by no later op, so the graph would free it
  at once.

Both are settled from the run itself at the iteration's end: which storages a fake tensor of the
program still holds (every FakeTensor object Python still has, found through the cyclic collector's
list of objects; memplan's own records of the graph hold detached meta tensors, not fake ones), and
for each storage a parameter's `.data` left or entered, the last op before it did (a property on
nn.Parameter and FakeTensor while the iteration runs: a parameter made from a fake tensor is a
FakeTensor marked `_is_param`). A storage the iteration starts with dies early only where a parameter
left it or the library says it drops it (DeepSpeed's accumulated gradients, after their last reader);
with no such evidence it stays to the end, the safe side. Only for data-parallel wrappers that
say they swap storages (`swaps_storages`), where it costs a scan of Python's objects.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

_TENSOR_DATA = torch._C.TensorBase.data  # the C++ getter and setter nn.Parameter inherits


@dataclass
class ParameterSwaps:
    """What Parameters' `.data` assignments did while watched, by storage (C++ address)."""

    left_at: dict[int, int] = field(default_factory=dict)  # storage -> ops recorded when a parameter last left it
    entered: dict[int, StorageWeakRef] = field(default_factory=dict)  # storages a parameter was pointed at


@contextlib.contextmanager
def parameter_data_swaps(node_count: Callable[[], int]) -> Iterator[ParameterSwaps]:
    """While active, each storage a Parameter's `.data` is pointed away from, with the number of ops
    recorded when it last was (`node_count()`: the storage lives at least through the op before that),
    and each storage one is pointed at."""
    swaps = ParameterSwaps()

    def swap(tensor: torch.Tensor, value: torch.Tensor) -> None:
        before = _TENSOR_DATA.__get__(tensor).untyped_storage()._cdata
        _TENSOR_DATA.__set__(tensor, value)
        after = value.untyped_storage()._cdata
        if after != before and isinstance(tensor, torch.nn.Parameter):
            swaps.left_at[before] = node_count()
            if value.untyped_storage().nbytes():  # not ZeRO-3's empty placeholder
                swaps.entered[after] = StorageWeakRef(value.untyped_storage())

    # A parameter made from a fake tensor is a FakeTensor marked `_is_param` (nn.Parameter.__new__'s
    # path for tensor subclasses), which isinstance(..., nn.Parameter) recognizes; a real one is an
    # nn.Parameter.
    for owner in (torch.nn.Parameter, FakeTensor):
        owner.data = property(_TENSOR_DATA.__get__, swap)  # type: ignore[assignment]
    try:
        yield swaps
    finally:
        del torch.nn.Parameter.data, FakeTensor.data


def tensors_python_holds(kind: type[torch.Tensor] = torch.Tensor) -> list[torch.Tensor]:
    """Every tensor of `kind` Python still has, tensors only a dropped cycle refers to collected first."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() reads __class__ of deprecated aliases (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, kind)]


def storages_held_by_fake_tensors() -> frozenset[int]:
    """The C++ addresses of the storages that some FakeTensor object Python still has refers to."""
    return frozenset(tensor.untyped_storage()._cdata for tensor in tensors_python_holds(FakeTensor))


@dataclass(frozen=True)
class SwappedStorages:
    """What settles the lifetimes of storages swapped under parameters (module docstring)."""

    swaps: ParameterSwaps
    held_at_end: frozenset[int]  # storage addresses some fake tensor still refers to as the iteration ends
    # Storages the iteration starts with that the library itself drops in it (its own word, e.g.
    # DeepSpeed's accumulated gradients; memplan.distributed.deepspeed): evidence like a parameter leaving.
    dropped: frozenset[int] = frozenset()


def settle_lifetimes(
    swapped: SwappedStorages,
    static: set[Any],
    read_until: dict[Any, int],
    last_use: dict[Any, int],
    end: int,
) -> None:
    """Lifetimes (`last_use`, by storage key, node indices; `read_until`: the last reader of each) where a
    library swapped storages under parameters (module docstring):
    a storage the iteration started with that a parameter left and nothing holds at its end lives
    through its last reader or the last op before the parameter left it, whichever is later, and one
    the library says it drops, through its last reader (one with neither keeps the graph's answer, to
    the end: nothing says when it went); one made during
    it that a parameter was pointed at and something still holds lives to the end (ZeRO-3's persistent
    parameters, gathered again after the step)."""
    for key in last_use:
        if not isinstance(key, StorageWeakRef):
            continue
        dropped_by = swapped.swaps.left_at.get(key.cdata, 0 if key.cdata in swapped.dropped else None)
        if key in static and key.cdata not in swapped.held_at_end and dropped_by is not None:
            last_use[key] = max(read_until.get(key, 0), dropped_by - 1)
        elif key not in static and key.cdata in swapped.swaps.entered and key.cdata in swapped.held_at_end:
            last_use[key] = end
