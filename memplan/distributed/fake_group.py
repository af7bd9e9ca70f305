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
from collections.abc import Iterator

from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan.errors import SettingsError


@contextlib.contextmanager
def fake_default_group(world_size: int, option: str) -> Iterator[None]:
    """`option` names the setting that needs the group, for the refusal."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    made = False
    with unset_fake_temporarily():  # what the group makes (a DeviceMesh's rank tensor) must be real
        if dist.is_initialized():
            if dist.get_backend() != "fake" or dist.get_world_size() != world_size:
                raise SettingsError(
                    f"{option} runs on a fake process group of {world_size} ranks, and this process has initialized "
                    "torch.distributed already: estimate in a process of its own (the memplan command)"
                )
        else:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
            made = True
    try:
        yield
    finally:
        if made:
            dist.destroy_process_group()
