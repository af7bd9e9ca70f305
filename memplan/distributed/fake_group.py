"""torch.distributed's default process group on torch's fake backend, made for a while and destroyed after.

Some of torch's distributed code asks the default group who this rank is (FSDP2's DeviceMesh, the
ZeroRedundancyOptimizer's rank and broadcast sources), so for those calls memplan initializes one
with the "fake" backend (FakeStore, torch.testing._internal.distributed.fake_pg), whose collectives
move nothing, and destroys it when they return: the process is left as it was. A process whose own
torch.distributed is initialized already is used as it is where it is a fake group of the same size,
and refused otherwise (memplan never touches a job's real group).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan.errors import SettingsError

P = ParamSpec("P")
R = TypeVar("R")
# A fake default group memplan made and left in place, because what runs on it needs it for as long
# as it lives (a DeepSpeed rank: memplan.distributed.deepspeed); destroyed before memplan makes another.
_lingering: list[object] = []


def leaves_no_process_group(function: Callable[P, R]) -> Callable[P, R]:
    """A library entry point after which the process has no group memplan made (a DeepSpeed rank's
    lingers while the rank is traced), as it had none before."""

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        finally:
            release_lingering_group()

    return run


def release_lingering_group() -> None:
    """Destroy the default group memplan left in place, if it is still the default group."""
    import torch.distributed as dist

    if _lingering and dist.is_initialized() and dist.group.WORLD is _lingering[0]:
        dist.destroy_process_group()
    _lingering.clear()


def _refusal(world_size: int, option: str) -> SettingsError:
    return SettingsError(
        f"{option} runs on a fake process group of {world_size} ranks, and this process has initialized "
        "torch.distributed already: estimate in a process of its own (the memplan command)"
    )


def _init_fake_group(world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def lingering_fake_group(world_size: int, option: str) -> None:
    """A new fake default group of `world_size` ranks, left in place for what needs it as long as it
    lives (a DeepSpeed rank); released before memplan makes another, and when a library call returns
    (leaves_no_process_group). `option` names the setting that needs it, for the refusal."""
    import torch.distributed as dist

    with unset_fake_temporarily():
        release_lingering_group()
        if dist.is_initialized():
            raise _refusal(world_size, option)
        _init_fake_group(world_size)
        _lingering[:] = [dist.group.WORLD]


def rank_fake_group(world_size: int, option: str) -> None:
    """The fake default group a rank runs on for as long as it lives: the process's own where that is a fake
    group of this size, else a lingering one (lingering_fake_group). An FSDP2 rank's step reduces across ranks
    through it in a real run (clip_grad_norm_'s total norm is a DTensor all-reduce, which finds its group by
    name), long after fully_shard built the mesh."""
    import torch.distributed as dist

    with unset_fake_temporarily():
        if dist.is_initialized() and not (_lingering and dist.group.WORLD is _lingering[0]):
            _use_the_process_s_own(world_size, option)
            return
    lingering_fake_group(world_size, option)


def _use_the_process_s_own(world_size: int, option: str) -> None:
    """The process's own initialized group is used where it is a fake one of this size, else refused."""
    import torch.distributed as dist

    if dist.get_backend() != "fake" or dist.get_world_size() != world_size:
        raise _refusal(world_size, option)


@contextlib.contextmanager
def fake_default_group(world_size: int, option: str) -> Iterator[None]:
    """`option` names the setting that needs the group, for the refusal."""
    import torch.distributed as dist

    made = False
    with unset_fake_temporarily():  # what the group makes (a DeviceMesh's rank tensor) must be real
        release_lingering_group()
        if dist.is_initialized():
            _use_the_process_s_own(world_size, option)
        else:
            _init_fake_group(world_size)
            made = True
    try:
        yield
    finally:
        if made:
            dist.destroy_process_group()
