"""One rank of DeepSpeed's ZeRO stage 2 or 3 the way users run it, for
tests/test_distributed_deepspeed.py: `deepspeed.initialize` over torch's fake process group as the
default group (its collectives move nothing; the memory is DeepSpeed's own), the engine's forward,
`engine.backward(loss)` and `engine.step()`, measured by torch's CPU allocator's own allocation and
free events. Nothing of memplan's is used."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch.profiler import record_function

from tests.hand_measure import peak_in_window, profiled_third_iteration, window


def bf16_rows(batch_size: int) -> torch.Tensor:
    """tests.fsdp_models' rows in bf16, the dtype of a model DeepSpeed trains in its own bf16."""
    from tests.fsdp_models import rows

    return rows(batch_size).to(torch.bfloat16)


def fp16_rows(batch_size: int) -> torch.Tensor:
    """tests.fsdp_models' rows in fp16, the dtype of a model DeepSpeed trains in its own fp16."""
    from tests.fsdp_models import rows

    return rows(batch_size).to(torch.float16)


def deepspeed_config(
    stage: int, batch_size: int, precision: str, zero: dict[str, Any] | None = None, grad_accum: int = 1
) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {"stage": stage, **(zero or {})},
    }
    if precision == "bf16":
        # The fake group's collectives write nothing, so a bucket's unwritten tail (torch.empty) can
        # read as inf in the gradient norm and skip the step as an overflow; a healthy step has none.
        # The norm is computed either way: the check's flag changes no allocation.
        config["bf16"] = {"enabled": True, "check_grad_overflow": False}
    if precision == "fp16":
        config["fp16"] = {"enabled": True}  # its overflow check always runs: measured_peak has it find none
    if precision in ("amp-bf16", "amp-fp16"):  # DeepSpeed's torch.autocast around the model, float32 master weights
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16" if precision == "amp-bf16" else "float16"}
    return config


def _no_overflow(engine: Any) -> None:
    """fp16's overflow check runs (its temporaries count) and finds none, as in a healthy step: the fake
    group's collectives write nothing, so a bucket's unwritten tail can read as inf and skip the step.
    The step's second check, of the gradient norm (`is_invalid_grad_norm`, stage3.py and stage_1_and_2.py),
    is answered in `_valid_grad_norms`."""
    check = engine.optimizer.has_overflow

    def has_overflow(*args: Any, **kwargs: Any) -> bool:
        check(*args, **kwargs)
        return False

    engine.optimizer.has_overflow = has_overflow


@contextlib.contextmanager
def _valid_grad_norms() -> Iterator[None]:
    """fp16's step also skips itself where the gradients' norm is inf or nan (`is_invalid_grad_norm`, imported
    into stage3.py and stage_1_and_2.py), which the fake group's unwritten buffers and a first loss scale
    of 2**16 make it in the first steps: a skipped step leaves ZeRO-3's persistent parameters released, so
    the next forward gathers them again, which a healthy steady-state step does not. Answered: valid."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    with contextlib.ExitStack() as stack:
        for module in (stage3, stage_1_and_2):
            if hasattr(module, "is_invalid_grad_norm"):
                stack.enter_context(patch.object(module, "is_invalid_grad_norm", lambda norm: False))
        yield


@contextlib.contextmanager
def _steps_never_skipped() -> Iterator[None]:
    """torch_autocast in float16: DeepSpeed's ZeRO optimizers step through torch's GradScaler, which skips the
    step where it finds an inf or nan in the gradients, and the fake group's unwritten buffers can hold them. The
    check runs (its `.item()` reads), and the step is taken, as in a healthy run."""

    def always_step(self: Any, optimizer: Any, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        for found_inf in optimizer_state["found_inf_per_device"].values():
            found_inf.item()
        return optimizer.step(*args, **kwargs)

    with patch.object(torch.amp.GradScaler, "_maybe_opt_step", always_step):
        yield


def _forget_deepspeeds_groups() -> None:
    """DeepSpeed keeps the default group it first saw in module globals; each run here makes a new one."""
    import deepspeed.comm.comm as deepspeed_comm
    import deepspeed.runtime.torch_autocast as torch_autocast
    import deepspeed.utils.groups as groups

    deepspeed_comm.cdb = None
    groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups.mesh_device = None
    # torch_autocast's state, which an engine with it sets and none clears (runtime/torch_autocast.py)
    torch_autocast.TORCH_AUTOCAST_INITIALIZED, torch_autocast.TORCH_AUTOCAST_DTYPE = False, None


def measured_peak(
    model_factory: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], torch.Tensor],
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    world_size: int,
    config: dict,
) -> int:
    """Rank 0's peak bytes in the third iteration of the real DeepSpeed step (two warm up), AdamW
    (torch's, handed to deepspeed.initialize as the client optimizer), with the variables deepspeed's
    launcher sets. An iteration is `gradient_accumulation_steps` micro-batches, each followed by
    `engine.step()` as accelerate calls it (the engine steps the optimizer at the last)."""
    return peak_in_window(_profiled_engine_run(model_factory, make_batch, loss_of, world_size, config), "measured")


def _profiled_engine_run(
    model_factory: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], torch.Tensor],
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    world_size: int,
    config: dict,
    on_engine: Callable[[Any], None] = lambda engine: None,
) -> Any:
    """measured_peak's run, profiled (hand_measure.profiled_third_iteration); `on_engine` is told of each
    engine as it is built."""
    with patch.dict(os.environ, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size)}):
        import deepspeed
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        from torch.testing._internal.distributed.fake_pg import FakeStore

        # (`import deepspeed.comm.torch as ...` would bind torch itself: deepspeed.comm has an attribute `torch`)
        deepspeed_torch_backend = importlib.import_module("deepspeed.comm.torch")

        deepspeed_torch_backend.build_shm_op = lambda: None  # a CPU shared-memory kernel, compiled on first use
        _forget_deepspeeds_groups()
        if dist.is_initialized():  # a group an earlier test left behind
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        linear = torch.nn.functional.linear  # stage 3 replaces it for the rest of the process
        try:

            def build() -> Callable[[], None]:
                torch.manual_seed(0)
                model = model_factory()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                # DeepSpeed's CPU accelerator offers fp16 only with oneDNN's fp16 kernels; torch's CPU ops run it.
                with patch.object(CPU_Accelerator, "is_fp16_supported", lambda self: True):
                    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
                on_engine(engine)
                if config.get("fp16", {}).get("enabled"):
                    _no_overflow(engine)
                rows = make_batch(config["train_micro_batch_size_per_gpu"])  # as the inputs function makes it

                def iteration() -> None:
                    for _ in range(config["gradient_accumulation_steps"]):
                        loss = loss_of(engine(rows), rows)
                        engine.backward(loss)
                        engine.step()

                return iteration

            fp16 = config.get("fp16", {}).get("enabled")
            autocast_fp16 = config.get("torch_autocast", {}).get("dtype") == "float16"
            with (
                _valid_grad_norms() if fp16 or autocast_fp16 else contextlib.nullcontext(),
                _steps_never_skipped() if autocast_fp16 else contextlib.nullcontext(),
            ):
                return profiled_third_iteration(build)
        finally:
            torch.nn.functional.linear = linear
            dist.destroy_process_group()


def measured_offload_peaks(
    model_factory: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], torch.Tensor],
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    world_size: int,
    config: dict,
) -> tuple[int, int]:
    """Rank 0's device and host peaks in the third iteration of the real DeepSpeed step under
    offload_optimizer (device "cpu"), run as measured_peak runs it, torch's AdamW the client optimizer
    (`zero_force_ds_cpu_optimizer: false`, as DeepSpeed asks of a client optimizer with offload).
    Host memory is what a GPU run would hold on the host, found two ways: what was allocated while the
    host computes (record_function("host") around the inner optimizer's step, which makes its state there,
    and around the host's gradient norm), and the host buffers DeepSpeed keeps, by the address of each
    at the run's end (stage_1_and_2.py and stage3.py make them on `self.device`, "cpu" under offload: the
    master partitions and their gradients, the 16-bit staging partitions, the one-parameter gradient
    staging buffer, the gradients accumulated on the host, stage 3's gradient partitions); the rest is
    the device's."""
    from tests.fsdp_models import _allocations, _window_peaks

    config = {**config, "zero_force_ds_cpu_optimizer": False}
    engines = []

    def with_host_regions(engine: Any) -> None:
        engines.append(engine)
        zero = engine.optimizer
        for owner, name in ((zero.optimizer, "step"), (zero, "complete_grad_norm_calculation_for_cpu_offload")):
            original = getattr(owner, name)

            def on_host(*args: Any, original: Callable = original, **kwargs: Any) -> Any:
                with record_function("host"):
                    return original(*args, **kwargs)

            setattr(owner, name, on_host)

    with _gradient_partitions_on_the_host_as_on_a_gpu(engines):
        recording = _profiled_engine_run(model_factory, make_batch, loss_of, world_size, config, with_host_regions)
    zero = engines[-1].optimizer
    kept = [value for state in zero.optimizer.state.values() for value in state.values()]
    for partition in [
        *getattr(zero, "single_partition_of_fp32_groups", []),
        *getattr(zero, "fp32_partitioned_groups_flat", []),
    ]:
        kept += [partition, partition.grad]
    kept += getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", [])
    kept += list(getattr(zero, "accumulated_grads_in_cpu", {}).values())
    kept += [
        getattr(zero, "temp_grad_buffer_for_cpu_offload", None),
        getattr(zero, "grad_partitions_flat_buffer", None),
    ]
    if _offloads_parameters(engines):  # the parameters' partitions (stage3.py, param_groups_fp16_flat_cpu_memory)
        kept += list(zero.param_groups_fp16_flat_cpu_memory)
    host_addresses = {tensor.untyped_storage().data_ptr() for tensor in kept if isinstance(tensor, torch.Tensor)}
    allocations = _allocations(recording)
    live_at_end: dict[int, int] = {}  # address -> index of its allocation still live at the end
    for index, (_, address, nbytes, _) in enumerate(allocations):
        if nbytes > 0:
            live_at_end[address] = index
        else:
            live_at_end.pop(address, None)
    kept_indices = {index for address, index in live_at_end.items() if address in host_addresses}
    allocations = [
        (at, address, nbytes, inside_host or index in kept_indices)
        for index, (at, address, nbytes, inside_host) in enumerate(allocations)
    ]
    return _window_peaks(allocations, window(recording, "measured"))


@contextlib.contextmanager
def _gradient_partitions_on_the_host_as_on_a_gpu(engines: list) -> Iterator[None]:
    """ZeRO-3 under offload_optimizer keeps its gradient partitions in a host buffer and, on a GPU, brings
    each over to the GPU to accumulate into it and take its norm (stage3.py, partition_grads: `.to(device)`
    where the accelerator says the buffer is not on it); under offload_param its parameters' partitions
    are in host buffers too, and each is copied to the GPU to be all-gathered (partition_parameters.py,
    `ds_tensor.to(current_device_name())`). On the CPU the accelerator says every tensor is on it and
    `.to(device)` returns the tensor itself: here those buffers are the host's and each such `.to` a copy,
    as on a GPU."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    def host_buffers() -> set[int]:
        zero = engines[-1].optimizer if engines else None
        buffers = [getattr(zero, "grad_partitions_flat_buffer", None)]
        buffers += getattr(zero, "param_groups_fp16_flat_cpu_memory", []) if _offloads_parameters(engines) else []
        return {buffer.untyped_storage().data_ptr() for buffer in buffers if isinstance(buffer, torch.Tensor)}

    plain_to = torch.Tensor.to
    plain_on_accelerator = CPU_Accelerator.on_accelerator

    def on_accelerator(self: Any, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() not in host_buffers() and plain_on_accelerator(self, tensor)

    def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = plain_to(tensor, *args, **kwargs)
        if out is not tensor:
            return out
        caller = sys._getframe(1).f_code
        brought_over = caller.co_name == "partition_grads" and caller.co_filename.endswith("stage3.py")
        gathered = caller.co_filename.endswith("partition_parameters.py") and (
            tensor.untyped_storage().data_ptr() in host_buffers()
        )
        return out.clone() if brought_over or gathered else out

    torch.Tensor.to = to  # type: ignore[method-assign]
    try:
        with patch.object(CPU_Accelerator, "on_accelerator", on_accelerator):
            yield
    finally:
        torch.Tensor.to = plain_to  # type: ignore[method-assign]


def _offloads_parameters(engines: list) -> bool:
    """Whether the last engine runs ZeRO-3 with offload_param on the host."""
    return bool(engines) and bool(getattr(engines[-1].optimizer, "offload_param", False))


class Branching(torch.nn.Module):
    """A forward that branches on a value, which fake tensors do not have."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 30, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return out * 2 if out.sum() > 0 else out


def branching() -> torch.nn.Module:
    return Branching()
