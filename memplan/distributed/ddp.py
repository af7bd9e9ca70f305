"""DistributedDataParallel, one rank (`--parallel ddp --world-size N`).

torch's own DDP wraps the model and runs over fake tensors on rank 0 of a process group whose
backend is torch's FakeProcessGroup (its collectives move nothing). The group is made for the
trace and never registered as the default group, so a job's own torch.distributed is left alone.

What a DDP rank holds and does beyond one GPU's step (torch/nn/parallel/distributed.py,
torch/csrc/distributed/c10d/reducer.cpp), all of it traced as it runs:
- Gradient buckets: the Reducer's flat tensors, one per bucket (the first up to 1 MiB, the rest up
  to bucket_cap_mb, 25 MiB), which hold every trainable gradient once more
  (gradient_as_bucket_view=False, the default). In the backward each gradient is copied into its
  bucket as it becomes ready, a full bucket is all-reduced, and at the end of the backward each
  .grad gets the averaged values back. DDP makes the buckets when it is built and makes them again
  at the second iteration's forward, in the order the gradients became ready (`_rebuild_buckets`).
  memplan runs one untraced iteration and that rebuild before it traces the steady state.
- Before each forward, the module's buffers are broadcast from rank 0 (broadcast_buffers=True),
  flattened and unflattened around the collective.

What the fake group needs, for the trace only:
- `_verify_param_shape_across_processes` is skipped. It checks that every rank holds the same
  parameters, which the one traced rank does by construction, and it reads tensor data in C++.
- The small integer tensors DDP's C++ makes from nothing and then reads (the bucket indices that
  `sync_bucket_indices` broadcasts, the parameters' shapes, the used-parameter map) are made real:
  a few bytes per parameter, left out of the figures.
- The comm hook. The fake group's all_reduce future carries no value, which DDP's built-in hook
  cannot take. memplan registers one that does to memory what the built-in does (torch's own
  `allreduce_hook`, ddp_comm_hooks/default_hooks.py) with NCCL: divide the bucket by the world size
  in place, all-reduce it in place, hand it back.

Not traced: NCCL's own communication buffers, outside torch's allocator (modelled as a band in
memplan.distributed.nccl and counted in the device figure, not here).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any
from unittest.mock import patch

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import SettingsError, TraceError


class UnusedParametersError(TraceError):
    """DDP's own refusal, said in one line: the step leaves trainable parameters without a gradient."""


_FACTORIES = (torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default)
_INDEX_DTYPES = (torch.int32, torch.int64)


class _ReducerTensors(TorchDispatchMode):
    """While DDP's C++ builds its Reducer or rebuilds its buckets: integer tensors it makes from
    nothing are real (it reads them), and the floating-point ones it makes are remembered (the
    buckets among them are those still alive when it is done)."""

    def __init__(self) -> None:
        super().__init__()
        self._made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func not in _FACTORIES:
            return func(*args, **kwargs)
        if kwargs.get("dtype") in _INDEX_DTYPES:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        made = func(*args, **kwargs)
        self._made.append(weakref.ref(made))
        return made

    def alive(self) -> list[torch.Tensor]:
        """What it made that something still holds: a tensor's Python object lives as long as
        the C++ side holds the tensor (PyObject preservation)."""
        return [tensor for ref in self._made if (tensor := ref()) is not None]


def _fake_process_group(world_size: int) -> Any:
    """A ProcessGroup of `world_size` ranks, this one rank 0, backed by FakeProcessGroup on every
    device, made without the default group (torch.testing._internal.distributed.fake_pg)."""
    from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup
    from torch.testing._internal.distributed.fake_pg import FakeStore

    backend = FakeProcessGroup._create_internal(0, world_size)
    group = ProcessGroup(FakeStore(), 0, world_size)
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, backend)
    return group


def _allreduce_in_place(world_size: int) -> Callable[..., torch.futures.Future]:
    # Unannotated: DDP checks a hook's annotations against dist.GradBucket and Future[Tensor], and
    # under `from __future__ import annotations` they would be strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        averaged = bucket.buffer().div_(world_size)  # what allreduce_hook does before NCCL's in-place all-reduce
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(averaged)
        return future

    return hook


class DataParallelRank:
    """One rank's DistributedDataParallel, built over fake tensors, and the gradient buckets its
    Reducer holds now."""

    def __init__(
        self,
        model: nn.Module,
        world_size: int,
        not_broadcast: list[str] | None = None,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        """`not_broadcast`: names of buffers that only memplan keeps as buffers (a quantized layer's
        constants, which bitsandbytes keeps as attributes): DDP would broadcast them before every
        forward, and real DDP never sees them. `gradient_as_bucket_view`: DDP's option, which makes
        each gradient a view into its bucket instead of a second copy."""
        from torch.nn.parallel import DistributedDataParallel

        if not any(param.requires_grad for param in model.parameters()):
            raise SettingsError(
                "--parallel ddp: the model has no trainable parameter, which DistributedDataParallel refuses; "
                "leave out --parallel"
            )
        if not_broadcast:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, not_broadcast)
        import torch.nn.parallel.distributed as ddp_module

        skip_shape_check = patch.object(ddp_module, "_verify_param_shape_across_processes", lambda *_, **__: None)
        with skip_shape_check, _ReducerTensors() as made:
            self.wrapper = DistributedDataParallel(
                model,
                process_group=_fake_process_group(world_size),
                gradient_as_bucket_view=gradient_as_bucket_view,
            )
        self._buckets = made.alive()
        self.wrapper.register_comm_hook(None, _allreduce_in_place(world_size))
        forward_prologue = self.wrapper._pre_forward

        def pre_forward(*args: Any, **kwargs: Any) -> Any:
            self.rebuild_buckets()  # first, where DDP would: then its own call finds nothing to do
            return forward_prologue(*args, **kwargs)

        self.wrapper._pre_forward = pre_forward

    @property
    def module(self) -> nn.Module:
        """The model DDP wraps."""
        return self.wrapper.module

    def after_warm_up(self) -> None:
        """What the warm-up iteration leaves to do before the traced one: the buckets made again."""
        self.rebuild_buckets()

    def rebuild_buckets(self) -> None:
        """What a forward after the first backward does first (`_pre_forward`): the buckets made
        again in the order that backward's gradients became ready. Once; later calls do nothing.
        Raises UnusedParametersError where the backward left parameters without a gradient, which
        DDP refuses then."""
        try:
            with _ReducerTensors() as made:
                rebuilt = self.wrapper.reducer._rebuild_buckets()
        except RuntimeError as error:
            if "find_unused_parameters" not in str(error):
                raise
            raise UnusedParametersError(
                "some trainable parameters get no gradient in the step, which DistributedDataParallel refuses at "
                "the next iteration unless built with find_unused_parameters=True, which memplan cannot trace yet: "
                "freeze those parameters (requires_grad=False) or make them reach the loss"
            ) from None
        if rebuilt:
            self._buckets = made.alive()

    def buckets(self) -> list[torch.Tensor]:
        return list(self._buckets)
