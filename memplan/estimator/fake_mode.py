"""The fake tensor mode memplan traces under: torch's FakeTensorMode, with one cache rule added; and
`constant_item`, the value a fake tensor's `.item()` answers while a step is traced.

FakeTensorMode caches each op's output metadata and, on a cache hit, builds fresh output tensors
from it. An op whose fake kernel returns one tensor in two places comes back from the cache as two
tensors with two storages, and from a miss as one: the same step traced twice in one process gave
two different peaks (1,536 B apart on the zoo's lstm-accum, whose `mkldnn_rnn_layer_backward` meta
kernel returned its bias gradient twice; the real kernel clones it, as its rule in
memplan.estimator.oprules.rnn now does). Such ops bypass the cache here, so every call returns what
the kernel returns.

And an op whose fake kernel refuses arguments the real kernel runs, or lays its output out otherwise
(memplan.estimator.oprules FAKE_KERNEL_RULES: `torch._grouped_mm` in float32), gets the output its rule gives, or
the outputs, one layout each, of an op returning several (`_ctc_loss`, which the fake mode refuses as data-dependent).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, _BypassDispatchCache
from torch.utils._mode_utils import no_dispatch

from memplan.estimator.buffer_values import MOST_REPLAYED_ELEMENTS
from memplan.estimator.fake_cache_keys import prep_args_for_hash
from memplan.estimator.fake_cache_outputs import FreshOutputs
from memplan.estimator.known_values import SHAPED_VALUE_FACTORIES, VALUE_FACTORIES
from memplan.estimator.oprules import FAKE_KERNEL_RULES


def _factory_elements(func: Any, args: Sequence[object]) -> int | None:
    """How many elements a factory of values (known_values.VALUE_FACTORIES) makes, from its arguments; None where
    they are not plain numbers."""
    if func is torch.ops.aten.scalar_tensor.default:
        return 1
    if func in (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step):
        bounds = [*args[:3]]
        if not all(isinstance(bound, int | float) and not isinstance(bound, bool) for bound in bounds):
            return None
        start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds[:2], bounds[2] if len(bounds) > 2 else 1)
        return max(0, math.ceil((end - start) / step)) if step else None
    size = args[0] if args else None
    if not isinstance(size, list | tuple) or not all(isinstance(n, int) and not isinstance(n, bool) for n in size):
        return None
    return math.prod(size)


def _shares_storage(outputs: tuple) -> bool:
    storages = [output.untyped_storage()._cdata for output in outputs if isinstance(output, torch.Tensor)]
    return len(set(storages)) < len(storages)


class _QuietWhileTracing(logging.Filter):
    """torch logs every fake kernel's failure with its traceback (fake_tensor.py, `log.exception("failed while
    attempting to run meta for %s")`) before raising it; memplan turns the failure into one line (trace_errors), and
    --debug shows the traceback. Drops the log's records while the thread that logs them is inside a TracingFakeMode
    (per thread, so that overlapping modes never leave the log silenced)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(self.depth, "value", 0) == 0


_QUIET = _QuietWhileTracing()
logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QUIET)


class TracingFakeMode(FakeTensorMode):
    """FakeTensorMode that does not cache ops whose outputs share storage, runs memplan's rule in place of the
    fake kernel where it has one (module docstring), keeps torch's log of a failing fake kernel quiet while
    it is entered (_QuietWhileTracing), and makes its cache keys and cached outputs faster
    (memplan.estimator.fake_cache_keys, memplan.estimator.fake_cache_outputs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fresh_outputs = FreshOutputs(self)

    def __enter__(self) -> Any:
        entered = super().__enter__()
        _QUIET.depth.value = getattr(_QUIET.depth, "value", 0) + 1
        return entered

    def __exit__(self, *exc_info: Any) -> Any:
        _QUIET.depth.value = getattr(_QUIET.depth, "value", 1) - 1
        return super().__exit__(*exc_info)

    # While a model is built: how each tensor made of constants was made (memplan.estimator.buffer_values).
    constants: Any = None
    # Whether the mode keeps the values of what is made of values (memplan.estimator.known_values): set by a batch
    # that carries some.
    keeps_values: bool = False

    def dispatch(self, func: Any, types: Sequence[type], args: Sequence[object] = (), kwargs: Any = None) -> object:
        out = self._dispatched(func, types, args, kwargs)
        if self.constants is not None:
            self.constants.record(func, args, kwargs or {}, out)
        return out

    def _dispatched(self, func: Any, types: Sequence[type], args: Sequence[object] = (), kwargs: Any = None) -> object:
        # A one-element factory of values keeps them in every trace (ModernBERT's multiple-choice head indexes with
        # `torch.full((), 0)`, which torch's indexing reads with `.item()`); any size where the mode keeps values.
        if func in VALUE_FACTORIES and (self.keeps_values or _factory_elements(func, args) == 1):
            made = self._made_with_values(func, args, kwargs or {})
            if made is not None:
                return made
        if self.keeps_values and func in SHAPED_VALUE_FACTORIES:
            return self._filled_like(func, types, args, kwargs or {})
        rule = FAKE_KERNEL_RULES.get(func)
        if rule is None:
            return super().dispatch(func, types, args, kwargs)
        layouts = rule(tuple(args), dict(kwargs or {}))
        single = len(func._schema.returns) == 1
        device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
        outputs = tuple(
            super(TracingFakeMode, self).dispatch(
                torch.ops.aten.empty_strided.default, types, (sizes, strides), {"dtype": dtype, "device": device}
            )
            for sizes, strides, dtype in ((layouts,) if single else layouts)
        )
        return outputs[0] if single else outputs

    def _made_with_values(self, func: Any, args: Sequence[object], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """A factory's output with its values (memplan.estimator.known_values), made for real on the CPU; None where
        it would not stay a constant (may_turn_const) or is asked for on another device."""
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return None
        if any(isinstance(leaf, torch.Tensor) for leaf in (*args, *kwargs.values())):
            return None
        elements = _factory_elements(func, args)
        if elements is None or elements > MOST_REPLAYED_ELEMENTS:
            return None  # (not made for real only to be dropped: may_turn_const would refuse it)
        with no_dispatch():
            out = func(*args, **kwargs)
        if not self.may_turn_const(out):
            return None
        return self.fake_tensor_converter.from_real_tensor(self, out, make_constant=True)

    def _filled_like(self, func: Any, types: Sequence[type], args: Sequence[object], kwargs: dict[str, Any]) -> Any:
        """ones_like, zeros_like, full_like (SHAPED_VALUE_FACTORIES) of integers or booleans: the fake output, laid
        out as the real one, its values one number at every element (beyond the elements a constant is kept for, a
        0-d tensor expanded to its sizes: the mask a CTC head counts frames over, [batch, samples], outgrows that
        bound at the batch sizes the largest-batch search tries)."""
        out = super().dispatch(func, types, args, kwargs)
        fill = {torch.ops.aten.ones_like.default: 1, torch.ops.aten.zeros_like.default: 0}.get(func)
        fill = args[1] if fill is None else fill
        if not isinstance(out, FakeTensor) or out.dtype.is_floating_point or out.dtype.is_complex:
            return out  # (masks and counts are what is read: a gradient's zeros_like keeps no copy of its size)
        if isinstance(fill, bool | int):
            with no_dispatch():
                filled = torch.full((), fill, dtype=out.dtype).expand(out.shape)
                # in place on an expanded tensor is refused ("more than one element ... refers to a single memory
                # location"): a copy of its own where one is kept at all, the expansion only beyond
                out.constant = filled.clone() if out.numel() <= MOST_REPLAYED_ELEMENTS else filled
        return out

    def may_turn_const(self, t: torch.Tensor) -> bool:
        """Whether an op's real result over values the mode has (a fake tensor's `constant`) stays a constant: torch
        keeps one-element results only (fake_tensor.py, CONSTANT_NUMEL_LIMIT); where the mode keeps values
        (memplan.estimator.known_values), memplan keeps any up to the elements it replays elsewhere
        (buffer_values.MOST_REPLAYED_ELEMENTS)."""
        return super().may_turn_const(t) or (
            self.keeps_values
            and t.numel() <= MOST_REPLAYED_ELEMENTS
            and t.layout == torch.strided
            and t.device.type == "cpu"
            and not self.is_our_fake(t)
        )

    def _prep_args_for_hash(self, result: list[object], args: Any, state: Any, id_hashed_objects: list[object]) -> None:
        # The cache key of a plain fake tensor written directly (memplan.estimator.fake_cache_keys): the same key.
        prep_args_for_hash(self, super()._prep_args_for_hash, result, args, state, id_hashed_objects)

    def _get_output_tensor_from_cache_entry(self, state: Any, entry: Any, key: Any, func: Any, args: Any) -> Any:
        # A plain output built directly (memplan.estimator.fake_cache_outputs): the same tensor.
        made = self._fresh_outputs.built(entry, func, args)
        return made if made is not None else super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)

    def _make_cache_entry(self, state: Any, key: Any, func: Any, args: Any, kwargs: Any, output: Any) -> Any:
        if isinstance(output, tuple) and _shares_storage(output):
            raise _BypassDispatchCache("outputs share storage")
        return super()._make_cache_entry(state, key, func, args, kwargs, output)


def steps_finding_no_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any
) -> Any:
    """`GradScaler._maybe_opt_step` (torch/amp/grad_scaler.py) as in a healthy step: its found-inf flags are read
    (`.item()`, as the real one reads them) and none is set, so the optimizer steps. Under fake tensors the constant
    `.item()` would set every flag, and the step, with its state, would never run: a user's step with an enabled
    GradScaler was 60% low on the CPU (a helper's bug hunt)."""
    for found_inf in optimizer_state["found_inf_per_device"].values():
        found_inf.item()
    return optimizer.step(*args, **kwargs)


# torch 2.6+'s (private: a torch without it leaves clip_grad_norm_ unpatched, refused as before where it checks)
_TOTAL_NORM = getattr(torch.nn.utils.clip_grad, "_get_total_norm", None)


def finite_total_norm(
    tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> torch.Tensor:
    """`clip_grad_norm_(..., error_if_nonfinite=True)`'s norm (torch/nn/utils/clip_grad.py, `_get_total_norm`) as in a
    healthy step: the norm, then its test, `torch.logical_or(total_norm.isnan(), total_norm.isinf())`, made as the real
    one makes it and found false, so no error is raised. Under fake tensors the test's `bool()` has no value to read:
    a step that asked for the check had been refused as data-dependent, its message blaming the user's own code."""
    assert _TOTAL_NORM is not None, "patched in only where torch has it (constant_item)"
    total_norm = _TOTAL_NORM(tensors, norm_type, False, foreach)
    if error_if_nonfinite:
        with torch.no_grad():
            torch.logical_or(total_norm.isnan(), total_norm.isinf())
    return total_norm


@contextlib.contextmanager
def constant_item() -> Iterator[None]:
    """Let optimizers call `.item()` on fake tensors (step counters, Adafactor's norms), and model factories read the
    tensors they make of constants: while a model is built (TracingFakeMode's `constants` set) such a tensor's
    `.item()` (and `.tolist()`, `float()`, which read it) answers its own value, replayed (buffer_values), where a
    constant had built what the real factory does not (timm's `DropPath` blocks for a stochastic-depth rate of 0).

    The value only steers arithmetic, never which tensors are allocated, so a constant is safe; where a value
    decides whether the optimizer steps (GradScaler's found-inf flags) or the step goes on (clip_grad_norm_'s
    error_if_nonfinite test), the step a healthy run takes is traced.
    """

    def item(self: FakeTensor) -> float | int | bool:
        if self.constant is not None and getattr(self.fake_mode, "keeps_values", False):
            return self.constant.item()  # values the mode keeps (memplan.estimator.known_values): as torch answers
        tracker = getattr(self.fake_mode, "constants", None)  # set while a model is built (TracingFakeMode)
        value = tracker.item(self) if tracker is not None else None
        if value is not None:
            return value  # a tensor made of constants: its own value (buffer_values.ConstantTracker.item)
        if self.dtype == torch.bool:
            return False
        return 2.0 if self.dtype.is_floating_point else 2

    plain_tolist = torch.Tensor.tolist

    def tolist(self: FakeTensor) -> Any:
        if self.constant is not None and getattr(self.fake_mode, "keeps_values", False):
            return self.constant.tolist()
        tracker = getattr(self.fake_mode, "constants", None)
        value = tracker.read(self, lambda real: real.tolist()) if tracker is not None else None
        return value if value is not None else plain_tolist(self)  # each element by `item` above

    # `float(loss)` reads a value as `.item()` does (logging: `running += float(loss)` had been refused as
    # data-dependent). `int()` and `bool()` stay refused: an int sizes tensors (`ids[:, :int(lengths.max())]`: a
    # constant 2 had traced a far smaller step), a bool decides a branch, which a constant would take blindly.
    readers = {"item": item, "__float__": lambda self: float(item(self)), "tolist": tolist}
    previous = {name: FakeTensor.__dict__.get(name) for name in readers}
    for name, reader in readers.items():
        setattr(FakeTensor, name, reader)
    try:
        with (
            patch.object(torch.amp.GradScaler, "_maybe_opt_step", steps_finding_no_inf),
            patch.object(torch.nn.utils.clip_grad, "_get_total_norm", finite_total_norm)
            if _TOTAL_NORM is not None
            else contextlib.nullcontext(),
        ):
            yield
    finally:
        for name, before in previous.items():
            if before is None:
                delattr(FakeTensor, name)
            else:
                setattr(FakeTensor, name, before)
