"""Measure a real CPU run of the canonical loop: the peak of live tensor storage bytes.

A dispatch mode sees every op's outputs; each storage is counted once from its first appearance
until a weakref finalizer reports it freed. Storages that existed before the measured iteration
(parameters, buffers, optimizer state, the batch, cached constants the model reads) are counted
for the whole iteration, except under a data-parallel wrapper that swaps storages under its
parameters (DeepSpeed: ZeRO-3 releases the gathered parameters an iteration starts with), where every
tensor Python holds as the iteration starts is counted until it is freed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memplan.distributed.fsdp import storage_resizes_observed
from memplan.distributed.modes import FSDP_MODES
from memplan.distributed.offload import HostCopies, copies_made
from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.composites import CompositeOp, PlainOpRule, plain_paths_tracked
from memplan.estimator.cpu_kernels import CHUNK_CAT_OPS
from memplan.estimator.engine_accumulation import EngineAccumulation, roots_hooked
from memplan.estimator.leaves import local_tensor, wraps_local_tensors
from memplan.estimator.loop import (
    TrainingState,
    current_grads,
    input_tensors,
    iteration,
    micro_batch,
    model_tensors,
    optimizer_step,
    optimizer_tensors,
    prepare,
)
from memplan.estimator.plain_formulas import PlainFormulaPaths
from memplan.estimator.rng_snapshots import rng_snapshots_counted
from memplan.estimator.swapped_storages import tensors_python_holds
from memplan.estimator.wrapped_numbers import WrappedNumber, WrappedNumbers
from memplan.finetune.bnb_kernels import is_gemm_4bit
from memplan.measure.collector import collector_held
from memplan.models.source import ModelSpec
from memplan.profiled_allocations import profiled_call, profiler_running
from memplan.settings import TrainingSettings


@dataclass(frozen=True)
class CpuMeasurement:
    peak_bytes: int
    static_bytes: int  # live before the iteration and throughout it


class LiveStorageCounter(TorchDispatchMode):
    """Counts bytes of live tensor storages created or read while active."""

    def __init__(self, statics_may_be_freed: bool = False, host: HostCopies | None = None) -> None:
        """`statics_may_be_freed`: a storage alive before the iteration is counted until it is freed, not
        to the iteration's end (where a library frees what the iteration started with: ZeRO-3's
        gathered parameters, released as its step begins). `host` (under offload): while it says `making`
        (FSDP2's copies to the host, DeepSpeed's host computation) nothing is counted, nor is what
        `leave_out` names (the rest of the host's memory)."""
        super().__init__()
        self._statics_may_be_freed = statics_may_be_freed
        self._host = host
        self._host_storages: set[int] = set()
        if host is not None:
            host.observers.append(self.leave_out)
        self.static_bytes = 0
        self.dynamic_bytes = 0
        # Tensors first read during the iteration that no op was seen making (_add_late), each with the most
        # dynamic bytes before it was first read; and the most since the last of them.
        self._late: list[tuple[weakref.ref, int, int]] = []
        self._segment_peak_bytes = 0
        self._live: dict[int, int] = {}  # id of the storage's C++ object -> bytes
        self._plain_paths = PlainFormulaPaths()
        # The C++ composite running now, and the op its plain path runs for each of its ops: the real run is under
        # this mode, so its composites take their subclass branches (memplan.estimator.composites.plain_paths_tracked)
        self.composite_ops: list[CompositeOp] | None = None
        self.composite_plain_op: PlainOpRule | None = None
        self.local_lifetimes: list[tuple[Any, int]] = []  # CompositeWatcher's; a real run holds what it holds
        # The engine's sums of a tensor's gradients, in place where a plain run's are
        # (memplan.estimator.engine_accumulation): each backward's Nodes are hooked from its roots as it starts.
        self._accumulation = EngineAccumulation()
        self._while_counting: contextlib.ExitStack | None = None
        self._entered = 0
        # the Python numbers ops are given for Tensor arguments, real tensors no dispatch shows (wrapped_numbers)
        self._wrapped: dict[WrappedNumber, int] = {}
        self._wrapped_numbers = WrappedNumbers(self._wrapped_made, self._wrapped_freed)

    def __enter__(self) -> LiveStorageCounter:
        if self._entered == 0:
            self._while_counting = contextlib.ExitStack()
            self._while_counting.enter_context(roots_hooked(self._accumulation))
            # the copies of the CPU generator's state a checkpoint takes, which no dispatch shows (rng_snapshots)
            self._while_counting.enter_context(rng_snapshots_counted(self.add_live))
        self._entered += 1
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            self._entered -= 1
            if self._entered == 0 and self._while_counting is not None:
                self._while_counting.close()
                self._wrapped_numbers.close()

    def _reached(self, dynamic_bytes: int) -> None:
        self._segment_peak_bytes = max(self._segment_peak_bytes, dynamic_bytes)

    def _add_late(self, tensor: torch.Tensor) -> None:
        """A tensor an op reads that neither the start of the iteration gave nor an op was seen making: one that
        existed before the iteration (a constant held outside the model's state), or one C++ made outside dispatch
        for this op (`ids[:, 0] = 3` makes its number: THPVariable_setitem's valueToTensor -> scalarToTensor, freed
        as the call returns). Counted from here until it is freed; one still alive after the iteration existed
        before it too, and peak_bytes counts it before it was read as well."""
        if self._statics_may_be_freed:
            self.add_static(tensor)
            return
        storage = local_tensor(tensor).untyped_storage()
        if storage._cdata in self._live or storage._cdata in self._host_storages:
            return
        self._late.append((weakref.ref(storage), storage.nbytes(), self._segment_peak_bytes))
        self._segment_peak_bytes = self.dynamic_bytes
        self.add_live(tensor)

    def _wrapped_made(self, key: WrappedNumber, nbytes: int) -> None:
        self._wrapped[key] = nbytes
        self.dynamic_bytes += nbytes
        self._reached(self.dynamic_bytes)

    def _wrapped_freed(self, key: WrappedNumber) -> None:
        self.dynamic_bytes -= self._wrapped.pop(key, 0)

    def leave_out(self, tensor: torch.Tensor) -> None:
        """Host memory under offload: never counted."""
        self._host_storages.add(local_tensor(tensor).untyped_storage()._cdata)

    def add_static(self, tensor: torch.Tensor) -> None:
        if local_tensor(tensor).untyped_storage()._cdata in self._host_storages:
            return
        if self._statics_may_be_freed:
            self.add_live(tensor)
            return
        storage = local_tensor(tensor).untyped_storage()
        key = storage._cdata
        if key not in self._live:
            self._live[key] = storage.nbytes()
            self.static_bytes += storage.nbytes()
            # Still counted for the whole iteration, but its key is dropped when it is freed: a later
            # storage may get the same C++ address, and was then taken for this one and never counted
            # (a constant T5 reads once, then a decoder activation: t5-selective-long measured
            # 262,144 B low in some runs and not others).
            weakref.finalize(storage, self._live.pop, key, None)

    def add_live(self, tensor: torch.Tensor) -> None:
        """A tensor no dispatch shows being made that Python may free during the iteration (the previous step's
        gradients under loops that zero them late, a checkpoint's copy of the CPU generator's state): counted until
        its storage is freed."""
        self._add_dynamic(tensor)
        self._reached(self.dynamic_bytes)

    def _add_dynamic(self, tensor: torch.Tensor) -> None:
        storage = local_tensor(tensor).untyped_storage()
        key = storage._cdata
        if key in self._live or key in self._host_storages:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.dynamic_bytes += nbytes
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.dynamic_bytes -= self._live.pop(key, 0)

    def resized(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        """A storage resized in place (FSDP2 allocates and frees its unsharded parameters so, which no
        dispatch mode sees): the difference allocated or freed now."""
        key = storage._cdata
        if key not in self._live:  # first seen now: it holds `before` bytes since before the iteration
            self._live[key] = before
            self.static_bytes += before
            weakref.finalize(storage, self._release, key)
        self._live[key] += after - before
        self.dynamic_bytes += after - before
        self._reached(self.dynamic_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if wraps_local_tensors(types):
            return NotImplemented  # counted as the ops on its local tensors
        if self._host is not None and self._host.making:
            return func(*args, **(kwargs or {}))  # a copy to the host (leave_out is told of it once made)
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage()._cdata not in self._live:
                self._add_late(leaf)  # host memory: never
        func = self._accumulation.op_for(func, args, kwargs)  # the engine's sum, in place as a plain run's
        func = self._plain_paths.op_for(func, args)  # the path a plain run's formula takes (plain_formulas)
        if self.composite_ops is not None and self.composite_plain_op is not None:
            func = self.composite_plain_op(func, args, self.composite_ops)  # a composite's plain path
        kernel = _python_kernel(func)
        profiled = str(func) in _ALLOCATING_KERNELS or _allocates_inside(func, args, kwargs or {})
        # a profiled kernel's own wrapped numbers and casts are among the allocator's events
        made = self._wrapped_numbers.before_op(func, args, kwargs or {}, kernel_measured=profiled)
        try:
            if profiled:
                out, inside = _with_kernel_allocations(func, args, kwargs or {})
                self._reached(self.dynamic_bytes + inside)
            elif kernel is None:
                out = func(*args, **(kwargs or {}))
            else:
                with self:  # the kernel's own ops, and the tensors they make, pass through the counter
                    out = kernel(*args, **(kwargs or {}))
        except BaseException:
            self._wrapped_numbers.after_op(made, None)  # the numbers went with the failed call
            raise
        self._plain_paths.made(out)
        if self.composite_ops is not None:
            self.composite_ops.append(CompositeOp.of(func, args, out, 0))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._add_dynamic(leaf)
        self._reached(self.dynamic_bytes)
        self._wrapped_numbers.after_op(made, out)
        return out

    @property
    def peak_bytes(self) -> int:
        """Read after the iteration: the statics, and the most dynamic bytes at any moment with the late tensors
        still alive (_add_late) counted before they were first read too."""
        peak, surviving_after = self._segment_peak_bytes, 0
        for storage, nbytes, peak_before in reversed(self._late):
            surviving_after += nbytes if storage() is not None else 0
            peak = max(peak, peak_before + surviving_after)
        return self.static_bytes + peak


# CPU kernels that allocate inside themselves, below the dispatcher's Python layer, where no dispatch mode sees,
# by op name: `_chunk_cat.out`, which FSDP2's reduce-scatter copy-in (`fsdp.chunk_cat`) calls, pads each tensor
# its chunks do not divide (memplan.estimator.cpu_kernels); and (_allocates_inside) kernels that hold their own
# ops' temporaries (memplan.estimator.composite_kernels). The counter reads those requests from the CPU
# allocator's own events.
_ALLOCATING_KERNELS = CHUNK_CAT_OPS


def _allocates_inside(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op's kernel holds temporaries of other ops (memplan.estimator.composite_kernels) in this call:
    only such calls are profiled (a profiler started per op is slow, and most sums cast nothing)."""
    return kernel_scratch_bytes(func, tuple(args), kwargs, "cpu") > 0


def _with_kernel_allocations(func: Any, args: tuple, kwargs: dict) -> tuple[Any, int]:
    """Run an op of _ALLOCATING_KERNELS; its output, and the most bytes its kernel held at once besides (its
    `out=` output is made before it runs), by torch.profiler's memory events. Under another profiler, which
    cannot nest, 0 (tests/hand_measure.py reads the whole step's events so)."""
    if profiler_running():
        return func(*args, **kwargs), 0
    out, peak, _ = profiled_call(lambda: func(*args, **kwargs))
    return out, peak


def _python_kernel(func: object) -> Callable[..., Any] | None:
    """The CPU kernel of an op whose kernel is Python code making tensors the counter would not see
    (a dispatch mode is off while the op it intercepted runs), to run under the counter instead:
    bitsandbytes' 4-bit matmul, whose CPU kernel dequantizes the whole weight before F.linear."""
    if not is_gemm_4bit(func):
        return None
    try:
        from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl
    except ImportError:  # a release that keeps it elsewhere: the op's output is still counted
        return None
    return _gemm_4bit_default_impl


def _static_tensors(state: TrainingState) -> list[torch.Tensor]:
    return model_tensors(state) + optimizer_tensors(state) + input_tensors(state)


def _real(tensor: torch.Tensor) -> bool:
    """A tensor with memory behind it: not a meta tensor, nor a fake one (an estimate's, in this process)."""
    return not tensor.is_meta and not isinstance(tensor, FakeTensor)


def measure_cpu(
    spec: ModelSpec, settings: TrainingSettings, *, warmup_iterations: int = 1, seed: int = 0
) -> CpuMeasurement:
    """Run `warmup_iterations` real iterations, then measure one steady-state iteration."""
    torch.manual_seed(seed)
    if settings.deepspeed_stage is not None and settings.lora_rank is not None:
        # peft's import and bitsandbytes' make module-level tensors (4-bit quantization tables, default arguments)
        # that the count below would take for the run's own (144 B over under peft 0.21); imported first, they are
        # the process's. bitsandbytes by name: peft 0.22 imports it only as it wraps the model (128 B over in CI).
        with contextlib.suppress(ImportError):  # without peft, prepare() says how to install it
            import peft  # noqa: F401
        with contextlib.suppress(ImportError):  # optional beside LoRA: only QLoRA needs it
            import bitsandbytes  # noqa: F401
    # The process's own tensors before the run (kept referenced, so that no id is another's later).
    # Under a step of the user's own, also: what the step itself keeps from one call to the next (optimizers it made,
    # tensors it leaves in globals or on the model) lives as the measured call starts.
    before = tensors_python_holds() if settings.deepspeed_stage is not None or settings.step is not None else []
    state = prepare(spec, settings)
    if settings.offload != "none" and settings.deepspeed_stage is None:
        return _measure_offloaded(state, warmup_iterations)
    # DeepSpeed's offload: its copies between the host and the GPU made as on a GPU (ZeRO-3's gradient and
    # parameter partitions brought over from the host: memplan.distributed.offload), what the rank keeps on
    # the host, and what the host's computation allocates (the rank tells `host` while it runs), left out of
    # the device's count.
    offloads = settings.deepspeed_stage is not None and settings.offloads_to_host
    with copies_made(state.data_parallel) if offloads else nullcontext(None) as host:
        for _ in range(warmup_iterations):
            iteration(state)
        swaps = getattr(state.data_parallel, "swaps_storages", False)
        # A step of the user's own may free what the iteration began with (optimizer.state.clear()): counted
        # until then, not to the end. Not yet on a DDP rank: there a step's measured peak then falls by one
        # bucket's bytes (tiny-gpt2, tests.custom_steps:two_views, 2 ranks: 8,234,628 -> 7,670,404 B), which
        # no independent count has settled; the prediction and the old count agree to the byte.
        own_step = settings.step is not None and state.data_parallel is None
        counter = LiveStorageCounter(statics_may_be_freed=swaps or own_step, host=host)
        if host is not None:
            state.data_parallel.host_copies = host
            for tensor in state.data_parallel.host_tensors():
                counter.leave_out(tensor)
        # Under a wrapper that swaps storages, every real tensor the run made that Python holds as the
        # iteration starts (DeepSpeed's partitions, buckets and gathered parameters, beside the model's and
        # the optimizer's tensors).
        _count_the_start(counter, state, {id(tensor) for tensor in before} if swaps or own_step else None)
        resizes = storage_resizes_observed(counter.resized) if settings.parallel in FSDP_MODES else nullcontext()
        with collector_held(), plain_paths_tracked(counter), counter, resizes:
            iteration(state)
    return CpuMeasurement(peak_bytes=counter.peak_bytes, static_bytes=counter.static_bytes)


def _count_the_start(counter: LiveStorageCounter, state: TrainingState, theirs_but: set[int] | None) -> None:
    """Give `counter` what the iteration begins with: the static tensors and the gradients, and where `theirs_but`
    is given, every real tensor Python holds but those ids. A function of its own so that no variable of the
    measuring frame holds one of them through the measured iteration (a loop's last gradient, held so, was counted
    until the iteration's end where a step that zeroes the gradients first frees it: 256 B to 65,536 B over)."""
    held = (
        [tensor for tensor in tensors_python_holds() if id(tensor) not in theirs_but and _real(tensor)]
        if theirs_but is not None
        else []
    )
    for tensor in _static_tensors(state) + held:
        counter.add_static(tensor)
    for grad in current_grads(state):
        counter.add_live(grad)


def _measure_offloaded(state: TrainingState, warmup_iterations: int) -> CpuMeasurement:
    """--offload params: the device's memory of one iteration, the host's left out: the shards, the
    optimizer state, FSDP2's gradient copies, and the optimizer step, which runs there (each of FSDP2's
    copies made as on a GPU: memplan.distributed.offload)."""
    with copies_made(state.data_parallel) as host:
        for _ in range(warmup_iterations):
            iteration(state)
        counter = LiveStorageCounter(host=host)
        for tensor in state.data_parallel.shards() + optimizer_tensors(state) + current_grads(state):
            counter.leave_out(tensor)
        for tensor in model_tensors(state) + input_tensors(state):
            counter.add_static(tensor)
        with collector_held(), plain_paths_tracked(counter), counter, storage_resizes_observed(counter.resized):
            for _ in range(state.settings.grad_accum):
                micro_batch(state)
                state.micro_batches_done += 1
        optimizer_step(state)
    return CpuMeasurement(peak_bytes=counter.peak_bytes, static_bytes=counter.static_bytes)
