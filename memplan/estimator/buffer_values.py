"""The real values of a model's buffers made from constants while its factory ran under fake tensors.

A causal mask registered as a buffer (`self.register_buffer("mask", torch.tril(torch.ones(T, T)))`, nanoGPT's and
minGPT's way, or a bool `triu` one), sliced and handed to nn.TransformerEncoder with no `is_causal`, has its values
read by torch (memplan.estimator.causal_masks). Under fake tensors a buffer has none, and the mask was refused as if it
came from the batch. The ops the factory ran are seen here as the fake mode runs them (TracingFakeMode's dispatch):
each output made only from constants (factories of values: `ones`, `full`, `arange`, and ops on their outputs) keeps
how it was made, not its values, and the buffers the built model holds keep theirs. The causal-mask reader replays a
buffer's ops on real tensors only when it reads it, at most the elements it replays for any mask.

Not constants: uninitialized memory (`empty` and its kin), random ops, anything read from a tensor that is not a
constant. A tensor whose storage an op wrote after it was made (a view of a base filled in place afterwards) is
unknown, unless the write was the op that made it (`torch.full(...).triu_(1)`), which is replayed as it ran.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

# Factories whose values are whatever memory held: never constants.
_UNINITIALIZED = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
        torch.ops.aten.empty_permuted.default,
    }
)

# The most elements of a mask replayed with real values: its makers' intermediates and torch's own causal mask stand
# beside it (about 1.1 GiB of this process's memory at 8,192 positions); past 4,096 positions the hint is asked for
# instead of the memory (memplan.estimator.causal_masks). A real tensor argument larger than this is not copied.
MOST_REPLAYED_ELEMENTS = 4096 * 4096


class _Made:
    """How a tensor was made: `func` run on `args`/`kwargs` (tensors among them _Made, or real tensors); its output
    `index` (None: the op's only output; "self": its first argument, written in place); `elements`: the most elements
    of any tensor a replay makes or reads (ConstantTracker._keep adds the output's)."""

    __slots__ = ("args", "elements", "func", "index", "kwargs")

    def __init__(self, func: Any, args: Any, kwargs: Any, index: int | str | None) -> None:
        self.func, self.args, self.kwargs, self.index = func, args, kwargs, index
        leaves = tree_flatten((args, kwargs))[0]
        self.elements = max(
            (
                leaf.elements if isinstance(leaf, _Made) else leaf.numel()
                for leaf in leaves
                if isinstance(leaf, _Made | torch.Tensor)
            ),
            default=0,
        )

    def replay(self, memo: dict[int, Any]) -> Any:
        if id(self) in memo:
            return memo[id(self)]

        def real(value: Any) -> Any:
            return value.replay(memo) if isinstance(value, _Made) else value

        args, kwargs = tree_map(real, self.args), tree_map(real, self.kwargs)
        if self.index == "self":
            args = (args[0].clone(), *args[1:])  # its input's value may be read elsewhere
            self.func(*args, **kwargs)
            value = args[0]
        else:
            out = self.func(*args, **kwargs)
            value = out if self.index is None else out[self.index]
        memo[id(self)] = value
        return value


class ConstantTracker:
    """Records how each fake tensor made of constants was made, while it is TracingFakeMode's `constants`."""

    def __init__(self) -> None:
        self._made = WeakTensorKeyDictionary()  # fake tensor -> (_Made, storage, its write count then)
        self._writes: dict[int, int] = {}  # storage's C++ address -> ops that wrote it

    def made(self, tensor: torch.Tensor) -> _Made | None:
        entry = self._made.get(tensor)
        if entry is None:
            return None
        made, storage, writes = entry
        key = tensor.untyped_storage()._cdata
        return made if key == storage and self._writes.get(key, 0) == writes else None

    def record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        schema = func._schema
        written = [
            index
            for index, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write and not argument.kwarg_only
        ]
        out_written = any(
            argument.alias_info is not None and argument.alias_info.is_write and argument.kwarg_only
            for argument in schema.arguments
        )
        constant = self._constant_arguments(func, args, kwargs)  # (read as they were before the op wrote them)
        outs = [
            kwargs.get(argument.name)
            for argument in schema.arguments
            if argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write
        ]
        # (a Tensor(a!)[] argument, `_foreach_zero_([buffer])`'s, writes each of its tensors)
        for tensor in tree_flatten([args[index] for index in written if index < len(args)] + outs)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:  # (a sparse one has no storage)
                key = tensor.untyped_storage()._cdata
                self._writes[key] = self._writes.get(key, 0) + 1
        if out_written or written not in ([], [0]) or constant is None:
            return
        made_args, made_kwargs = constant
        if written == [0]:
            if isinstance(args[0], FakeTensor):
                self._keep(args[0], _Made(func, made_args, made_kwargs, "self"))
            return
        if isinstance(out, FakeTensor):
            self._keep(out, _Made(func, made_args, made_kwargs, None))
        elif isinstance(out, tuple | list):
            for index, each in enumerate(out):
                if isinstance(each, FakeTensor):
                    self._keep(each, _Made(func, made_args, made_kwargs, index))

    def item(self, tensor: torch.Tensor) -> float | int | bool | None:
        """The real value of `tensor`, a one-element fake tensor made of constants while the model was built, replayed
        from the ops that made it; None where it is not one, or its replay would make or read a tensor of more than
        MOST_REPLAYED_ELEMENTS elements. What a factory reads with `.item()` or `.tolist()` from such a tensor
        decides what it builds: timm's stochastic-depth rates (`calculate_drop_path_rates`, timm/layers/drop.py:
        `torch.linspace(0, drop_path_rate, depth)` read back as floats, as the official Swin, ConvNeXt and DeiT
        code reads them) make a block's `DropPath` where the rate is above 0 and an `nn.Identity` where it is 0."""
        return self.read(tensor, lambda value: value.item() if value.numel() == 1 else None)

    def read(self, tensor: torch.Tensor, reader: Callable[[torch.Tensor], Any]) -> Any:
        """`reader` applied to the real value of `tensor` (item's), replayed once (`.tolist()` reads a whole tensor so,
        where a fake tensor's reads each element with its own `.item()`, each a replay of the whole chain); None where
        there is no such value."""
        made = self.made(tensor)
        if made is None or made.elements > MOST_REPLAYED_ELEMENTS or tensor.device.type != "cpu":
            return None  # a cuda constant's replay would run on a real GPU where there is one, starting its context
        with _disable_current_modes():  # real tensors, which no mode is to see
            try:
                value = made.replay({})
            except (RuntimeError, TypeError, ValueError):
                return None
            if not isinstance(value, torch.Tensor) or value.shape != tensor.shape or value.dtype != tensor.dtype:
                return None
            return reader(value)

    def written(self, tensor: torch.Tensor) -> None:
        """A write to `tensor` that no op recorded (an initialiser memplan skips while building, hf_patches'
        no_weight_init): its value is no longer what made it, so it reads as a constant again."""
        key = tensor.untyped_storage()._cdata
        self._writes[key] = self._writes.get(key, 0) + 1

    def _keep(self, tensor: torch.Tensor, made: _Made) -> None:
        if tensor.layout != torch.strided:  # a sparse tensor has no storage of its own: never a mask
            return
        made.elements = max(made.elements, tensor.numel())
        key = tensor.untyped_storage()._cdata
        self._made[tensor] = (made, key, self._writes.get(key, 0))

    def _constant_arguments(self, func: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if func in _UNINITIALIZED or torch.Tag.nondeterministic_seeded in func.tags:
            return None
        leaves, _ = tree_flatten((args, kwargs))
        if any(isinstance(leaf, FakeTensor) and self.made(leaf) is None for leaf in leaves):
            return None

        def made(value: Any) -> Any:
            if isinstance(value, FakeTensor):
                return self.made(value)
            if isinstance(value, torch.Tensor):
                with _disable_current_modes():
                    return value.detach().clone()  # a real tensor, as it is now
            return value

        if any(
            isinstance(leaf, torch.Tensor)
            and not isinstance(leaf, FakeTensor)
            and leaf.numel() > MOST_REPLAYED_ELEMENTS
            for leaf in leaves
        ):
            return None  # a real weight the factory loads, say: not copied (no mask reads one)
        return tree_map(made, args), tree_map(made, kwargs)


# storage's C++ address of a built model's buffer -> (the buffer, weakly; how it was made)
_KEPT: dict[int, tuple[weakref.ref, _Made]] = {}


@contextlib.contextmanager
def constants_tracked(fake_mode: Any) -> Iterator[ConstantTracker]:
    """While the model is built under `fake_mode` (a TracingFakeMode); then `keep_buffers(model, tracker)`."""
    tracker = ConstantTracker()
    previous = getattr(fake_mode, "constants", None)
    fake_mode.constants = tracker
    try:
        yield tracker
    finally:
        fake_mode.constants = previous


def keep_buffers(tensors: Any, tracker: ConstantTracker) -> None:
    """How each of `tensors` (a built model's buffers and tensor attributes) made of constants was made, for
    `buffer_value` to replay while the model lives."""
    for tensor in tensors:
        made = tracker.made(tensor) if isinstance(tensor, FakeTensor) else None
        if made is None:
            continue
        key = tensor.untyped_storage()._cdata
        _KEPT[key] = (weakref.ref(tensor, lambda _, key=key: _KEPT.pop(key, None)), made)


def buffer_value(alias: torch.Tensor, most_elements: int) -> torch.Tensor | None:
    """The real values of `alias` (a node's meta alias of a kept buffer, or of a view of it), replayed from the ops
    that made the buffer; None where it is no kept buffer's, or the buffer has more than `most_elements`."""
    entry = _KEPT.get(alias.untyped_storage()._cdata)
    if entry is None:
        return None
    buffer = entry[0]()
    if buffer is None or buffer.untyped_storage()._cdata != alias.untyped_storage()._cdata:
        return None
    if buffer.numel() > most_elements:
        return None
    with _disable_current_modes():  # real tensors, which no mode is to see
        try:
            value = entry[1].replay({})
            if (
                not isinstance(value, torch.Tensor)
                or value.dtype != buffer.dtype
                or value.shape != buffer.shape
                or value.stride() != buffer.stride()
                or value.storage_offset() != buffer.storage_offset()
            ):
                return None
            return value.as_strided(alias.shape, alias.stride(), alias.storage_offset())
        except (RuntimeError, TypeError, ValueError):
            return None
