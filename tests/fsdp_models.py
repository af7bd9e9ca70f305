"""A model sharded with FSDP2 the way users set it up, for tests/test_distributed_fsdp.py, and its
real step measured by torch's CPU allocator: torch's fake process group as the default group (its
collectives move nothing; the memory is FSDP2's own), fully_shard on each block and then the root,
AdamW or SGD, and the allocator's own allocation and free events from torch's profiler, from before
the model is built (the process group and its DeviceMesh are made before, as a job makes them at
start-up). Of memplan's, only the recorder of those events is used (memplan.profiled_allocations, torch's
profiler with user scopes only)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import record_function

from memplan.profiled_allocations import AllocationRecording
from tests.hand_measure import (
    checkpoint_each,
    profiled_third_iteration,
    profiled_third_iteration_peak,
    training_iteration,
    window,
)

WIDTH, HIDDEN, BLOCKS = 64, 256, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(WIDTH, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Stack(nn.Module):
    """An embedding-like first layer and a head the root owns, three blocks FSDP2 shards each."""

    def __init__(self, head_rows: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        # 3 rows: not divisible by the world size, so rank 0's shard is padded
        self.head = nn.Linear(WIDTH, head_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack() -> nn.Module:
    return Stack()


# A vocabulary-sized head whose rows no even world divides (GPT-2's 50,257, scaled down): FSDP2's reduce-scatter
# copies its gradient once more, padded, on the CPU (memplan.estimator.cpu_kernels).
WIDE_HEAD_ROWS = 4001


def wide_head_stack() -> nn.Module:
    return Stack(WIDE_HEAD_ROWS)


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.square().mean()


def measured_peak(
    world_size: int,
    batch_size: int,
    reshard_after_forward: bool,
    checkpoint: bool = False,
    optimizer: str = "adamw",
    grad_accum: int = 1,
    shard_size: int | None = None,
    head_rows: int = 3,
    param_dtype: torch.dtype | None = None,
) -> int:
    """Rank 0's peak bytes in the third iteration of the real step (two warm up). With `shard_size`,
    HSDP: the mesh is world_size / shard_size replicas by shard_size shards, as torch's docs build it. With
    `param_dtype`, FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype=torch.float32), torchtitan's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        if shard_size is None:
            mesh = init_device_mesh("cpu", (world_size,))
        else:
            mesh = init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("dp", "shard"))

        def build() -> Callable[[], None]:
            torch.manual_seed(0)
            model = Stack(head_rows)
            if checkpoint:
                checkpoint_each(model.blocks)
            options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
            if param_dtype is not None:
                options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, **options)
            fully_shard(model, **options)
            if optimizer == "adamw":
                step = torch.optim.AdamW(model.parameters(), lr=1e-3)
            else:
                step = torch.optim.SGD(model.parameters(), lr=1e-3)
            return training_iteration(model, rows(batch_size), mean_square, step, grad_accum)

        return profiled_third_iteration_peak(build)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _copies_as_on_a_gpu() -> Iterator[None]:
    """FSDP2's CPUOffloadPolicy copies each shard to the device before its all-gather (`_fsdp_param.py`)
    and each reduced gradient to the host (`_fsdp_collectives.py`) with `.to(device)`, which on a CPU-only
    run returns the tensor itself: here each is a copy, as on a GPU, the host ones made inside
    record_function("host")."""
    plain_to = torch.Tensor.to

    def to(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = plain_to(tensor, *args, **kwargs)
        if out is not tensor or not any(isinstance(arg, torch.device) for arg in (*args, *kwargs.values())):
            return out
        caller = sys._getframe(1).f_code.co_filename
        if caller.endswith("_fsdp_collectives.py"):
            with record_function("host"):
                return out.clone()
        return out.clone() if caller.endswith("_fsdp_param.py") else out

    torch.Tensor.to = to
    try:
        yield
    finally:
        torch.Tensor.to = plain_to


def _allocations(recording: AllocationRecording) -> list[tuple[int, int, int, bool]]:
    """Every allocation and free event of the CPU allocator: (time, address, bytes, inside "host")."""
    found = []

    def walk(events: list, inside_host: bool) -> None:
        for event in events:
            if event.tag == _EventType.Allocation:
                fields = event.extra_fields
                found.append((event.start_time_ns, fields.ptr, fields.alloc_size, inside_host))
            walk(event.children, inside_host or event.name == "host")

    walk(recording.kineto_results.experimental_event_tree(), False)
    return sorted(found, key=lambda allocation: allocation[0])


def measured_offload_peaks(
    world_size: int, batch_size: int, reshard_after_forward: bool, checkpoint: bool = False, grad_accum: int = 1
) -> tuple[int, int, int]:
    """Rank 0's device and host peaks in the third iteration, and the device's in its last forward (with the
    loss), under FSDP2's CPUOffloadPolicy (unpinned: this
    torch has no GPU to pin for), AdamW. Host memory is what was allocated inside record_function("host"):
    the shards fully_shard makes, the optimizer step (it runs on the host, and makes its state there), and
    the gradient copies; the rest is the device's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)

        def build() -> Callable[[], None]:
            torch.manual_seed(0)
            model = Stack()
            if checkpoint:
                checkpoint_each(model.blocks)
            with record_function("host"):
                for block in model.blocks:
                    fully_shard(block, **options)
                fully_shard(model, **options)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            batch = rows(batch_size)

            def iteration() -> None:
                for _ in range(grad_accum):
                    with record_function("forward"):
                        loss = mean_square(model(batch), batch)
                    (loss / grad_accum if grad_accum > 1 else loss).backward()
                with record_function("host"):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            return iteration

        with _copies_as_on_a_gpu():
            recording = profiled_third_iteration(build)
    finally:
        dist.destroy_process_group()
    allocations = _allocations(recording)
    device, host = _window_peaks(allocations, window(recording, "measured"))
    forward_device, _ = _window_peaks(allocations, window(recording, "forward", last=True))
    return device, host, forward_device


def _window_peaks(allocations: list[tuple[int, int, int, bool]], window: tuple[int, int]) -> tuple[int, int]:
    """The most device and host bytes live within `window`."""
    start, end = window
    live: dict[int, tuple[int, bool]] = {}
    totals = {False: 0, True: 0}
    peaks = {False: 0, True: 0}
    for at, address, nbytes, inside_host in allocations:
        if nbytes > 0:
            live[address] = (nbytes, inside_host)
            totals[inside_host] += nbytes
        else:
            freed, was_host = live.pop(address, (0, False))
            totals[was_host] -= freed
        if start <= at <= end:
            for kind in (False, True):
                peaks[kind] = max(peaks[kind], totals[kind])
    return peaks[False], peaks[True]
