"""DeepSpeed's ZeRO stages 1, 2 and 3, one rank (`--parallel zero2|zero3 --world-size N`, and `zero1` with a
--deepspeed file): DeepSpeed itself, traced.

memplan runs DeepSpeed's own engine (`deepspeed.initialize` with memplan's optimizer as the client
optimizer, the engine's forward, `engine.backward(loss)`, `engine.step()`) on rank 0 of torch's fake
process group over fake tensors, as it runs torch's DDP and FSDP2, so what the rank holds is what
DeepSpeed allocates.
- Stage 2 (runtime/zero/stage_1_and_2.py): every rank keeps the whole model (16-bit with
  `--precision bf16`, float32 otherwise), flattened into one buffer per parameter group; the
  optimizer's float32 master copy of the rank's 1/N partition and its state; in the backward, each
  gradient copied as it becomes ready into a reduce bucket of `reduce_bucket_size` elements
  (500,000,000 by default: 2 GB in float32, 1 GB in bf16, whatever the model's size), reduced, and
  the rank's share kept in a partition-sized buffer for the step.
- Stage 1 (the same optimizer without partitioning the gradients): whole gradients, accumulated in each
  parameter's own `.grad` and reduced in the step, and 1/N of the master copy and optimizer state.
- Stage 3 (runtime/zero/stage3.py, partition_parameters.py): the parameters are partitioned too.
  Each is an empty tensor between uses; before a module runs its parameters are gathered into a new
  buffer, and after it they are released, except those under `stage3_param_persistence_threshold`
  elements (100,000 by default), which stay gathered from one step's end to the next step's start.
  Prefetching (`stage3_prefetch_bucket_size`, `stage3_max_live_parameters`) and the reduce bucket
  are DeepSpeed's to apply, as in a real run.
The rest of DeepSpeed's configuration (`--deepspeed ds_config.json`: its `zero_optimization`
section, bucket sizes, `overlap_comm`, `contiguous_gradients`) is DeepSpeed's to apply too; what memplan
sets in it is memplan.distributed.deepspeed_config's.

What the fake tensors need from DeepSpeed (each a check of values, not an allocation): its overflow
test reads tensors as bools and a byte tensor with `.item()` (answered: no overflow, as a healthy step
has none), and so do torch's GradScaler under torch_autocast in float16 and the gradient-norm check that
skips a step (answered: valid; in a real run on the fake group, validate's, the unwritten buckets would say
otherwise); stage 3's cross-rank consistency assertions (`assert_ints_same_as_other_ranks`) compare
values across ranks, which a fake group does not have (skipped). DeepSpeed keeps the
default process group it first sees in module globals, so each rank's engine is built on a fresh fake
group and those globals are cleared first; the group lives as long as the rank, since every forward,
backward and step uses it (memplan.distributed.fake_group releases it before it makes another).
DeepSpeed points tensors at other storages with `tensor.data = ...` (each gradient at its place in
the bucket; stage 3's parameters at their gathered or empty buffers), which no dispatch mode sees:
the recorder then reads such a tensor from the op that made its storage (memplan.estimator.recorder,
`producers`), and the storages' lifetimes are settled from what the run still holds at the
iteration's end (memplan.estimator.swapped_storages).

Gradient accumulation (`--grad-accum N`) is DeepSpeed's own: `gradient_accumulation_steps` is N, the
engine divides each micro-batch's loss by it and reduces each micro-batch's gradients into the rank's
partition as they become ready, and the loop calls `engine.step()` after every micro-batch, as
accelerate does; the optimizer runs at the last. The traced micro-batch is a step's last, after one
untraced micro-batch made the accumulated partition. What that micro-batch left and the step drops (stage 1's
gradients and reduce bucket, stage 2's accumulated gradients) dies in the traced one (`dropped_in_step`).

`--precision bf16` and `fp16` are DeepSpeed's own: a 16-bit model and a float32 master partition, fp16
with DeepSpeed's dynamic loss scale, at every stage. `amp-bf16` and `amp-fp16` are its `torch_autocast`: a
float32 model whose forward the engine runs in torch.autocast of that dtype (the only autocast region: memplan's
loop opens none around an engine, as accelerate does not), the listed modules' gradients reduced in 16 bits, and
in float16 torch's GradScaler inside the ZeRO optimizer (its found-inf check runs and finds none).

`--offload optimizer` (offload_optimizer) and, on stage 3, `--offload params` (offload_param): the host's
buffers and compute told apart from the GPU's (memplan.distributed.offload). Not traced yet: NVMe offload
(refused in one line).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.distributed.deepspeed_collectives import per_rank_loops_replaced
from memplan.distributed.deepspeed_fakes import (
    NO_AUTOCAST,
    answer_no_overflow,
    as_deepspeed_cpu_adam,
    autocast_globals,
    config_errors_in_one_line,
    cpu_accelerator,
    fake_tensors_tolerated,
    fresh_fake_group,
    import_deepspeed,
)
from memplan.distributed.modes import DEEPSPEED_MODE_OF_STAGE
from memplan.distributed.offload import HostCopies, HostMemory
from memplan.errors import SettingsError


class DeepSpeedRank:
    """Rank 0 of a DeepSpeed ZeRO job over fake tensors: its engine is the model the loop calls."""

    # DeepSpeed points tensors at other storages with `tensor.data = ...` (ZeRO-2's gradients at
    # their bucket, ZeRO-3's parameters at their gathered or empty buffers), which no dispatch mode
    # sees: the recorder reads such a tensor from the op that made its storage now.
    swaps_storages = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        world_size: int,
        config: dict[str, Any],
        pins_host_memory: bool = False,
        cpu_adam: bool = False,
    ) -> None:
        """`config`: as deepspeed_config makes it (its zero_optimization.stage is 1, 2 or 3). Under
        offload_optimizer the host memory is pinned where `pins_host_memory` (a GPU run) and DeepSpeed's
        `pin_memory` say so, and `optimizer` steps as DeepSpeedCPUAdam where `cpu_adam`
        (runs_deepspeed_cpu_adam)."""
        deepspeed = import_deepspeed()
        from memplan.estimator.held_tensors import LIBRARIES_HOLDING_TENSORS

        self.stage = config["zero_optimization"]["stage"]
        option = f"--parallel {DEEPSPEED_MODE_OF_STAGE[self.stage]}"

        if not any(param.requires_grad for param in model.parameters()):
            raise SettingsError(f"{option}: the model has no trainable parameter; leave out --parallel")
        LIBRARIES_HOLDING_TENSORS.add(os.path.dirname(os.path.dirname(deepspeed.runtime.engine.__file__)))
        # Stage 3's all-gather handles keep their flat buffer until a fetch's last parameter is waited for
        # (the file only: in its directory, stage 2's code points tensors at other storages, which a
        # holder's lifetime would extend to the tensor's).
        LIBRARIES_HOLDING_TENSORS.add(deepspeed.runtime.zero.partition_parameters.__file__)
        self.world_size = world_size
        fresh_fake_group(world_size, option)
        linear = torch.nn.functional.linear
        try:
            with (
                fake_tensors_tolerated(self.world_size),
                config_errors_in_one_line(),
                autocast_globals(NO_AUTOCAST) as self._autocast,
            ):
                self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        finally:
            # Stage 3 puts its own linear in torch.nn.functional for the rest of the process
            # (partition_parameters.py, _enable_mem_efficient_linear: "This will persist unless manually
            # reset"): the rank's model runs with it, as in the job, and the rest of memplan's process without.
            self._linear = torch.nn.functional.linear
            torch.nn.functional.linear = linear
        self.module: nn.Module = self.engine.module
        self.wrapper = self.engine
        offload_config = self.engine.zero_offload_optimizer()  # DeepSpeed's parsed section, its defaults filled
        device = getattr(offload_config, "device", None)
        self.offload = getattr(device, "value", device) == "cpu"  # an OffloadDeviceEnum
        self.pins_host_memory = self.offload and pins_host_memory and bool(offload_config.pin_memory)
        # Under offload_optimizer, when the host computes (node indices from `node_clock`, which the trace
        # sets): the optimizer's step over the master partitions, and the gradient norm taken on the host.
        self.host_windows: list[tuple[int, int]] = []
        self.node_clock: Callable[[], int] | None = None
        # A real run measured on the CPU (memplan.measure.cpu): told while the host computes, so that what it
        # allocates then is left out of the device's count.
        self.host_copies: HostCopies | None = None
        self.cpu_adam = self.offload and cpu_adam
        # Under offload_param (ZeRO-3), the parameters' 16-bit partitions in one host buffer per group
        # (stage3.py, _create_param_groups_fp16_flat_cpu_memory), each gathered by way of a copy to the GPU.
        param_config = self.engine.zero_offload_param() if self.stage == 3 else None
        param_device = getattr(param_config, "device", None)
        offloads_parameters = getattr(param_device, "value", param_device) == "cpu"
        self._parameters_on_host: list[torch.Tensor] = (
            list(self.engine.optimizer.param_groups_fp16_flat_cpu_memory) if offloads_parameters else []
        )
        self.host_parameter_storages = frozenset(
            StorageWeakRef(tensor.untyped_storage()) for tensor in self._parameters_on_host
        )
        # offload_param has its own pin_memory (stage3.py pins the buffers where it says so)
        self._pins_parameters = offloads_parameters and pins_host_memory and bool(param_config.pin_memory)
        if self.offload:
            zero = self.engine.optimizer
            if self.cpu_adam:
                as_deepspeed_cpu_adam(zero.optimizer)
            self._timed_on_host(zero.optimizer, "step")
            self._timed_on_host(zero, "complete_grad_norm_calculation_for_cpu_offload")
        self._noted: dict[StorageWeakRef, tuple[int, str]] = {}
        self._accumulated: frozenset[int] = frozenset()
        self._note_released_buckets()
        answer_no_overflow(self.engine.optimizer)

    def _timed_on_host(self, owner: object, name: str) -> None:
        """`owner.name` noted in host_windows each time it runs while a node clock is set."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def on_host(*args: Any, **kwargs: Any) -> Any:
            clock, copies = self.node_clock, self.host_copies
            start = clock() if clock is not None else None
            if copies is not None:
                copies.making = True
            try:
                return original(*args, **kwargs)
            finally:
                if copies is not None:
                    copies.making = False
                if clock is not None and start is not None:
                    self.host_windows.append((start, clock()))

        setattr(owner, name, on_host)

    def backward(self, loss: torch.Tensor) -> None:
        with self._running():
            self.engine.backward(loss)
        # The rank's reduced gradient partition, which the step reads and then drops.
        for value in getattr(self.engine.optimizer, "averaged_gradients", {}).values():
            for tensor in value if isinstance(value, list | tuple) else [value]:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    self._noted[StorageWeakRef(storage)] = (storage.nbytes(), "gradients")

    def step(self) -> None:
        """DeepSpeed's step: the optimizer over the rank's partition, the parameters gathered back
        (ZeRO-2) and the gradients zeroed, all inside the engine."""
        with self._running():
            self.engine.step()

    def after_micro_batch(self) -> None:
        """What a job's loop calls after each micro-batch but a step's last: `engine.step()`, which
        there only counts the micro-batch (engine.py `step`: the optimizer runs only at the
        accumulation boundary, which the engine's `micro_steps` tells). accelerate, and so the Trainer,
        calls it after every backward (accelerate/utils/deepspeed.py, DeepSpeedEngineWrapper.backward)."""
        self.step()

    def skip_micro_batches(self, count: int) -> None:
        """Count `count` micro-batches as run without running them: a later micro-batch of a step finds
        what the first left (the accumulated gradient partition; the ZeRO optimizer's `micro_step_id`
        past 0, so it adds rather than copies), and only the engine's counter tells the step's last."""
        self.engine.micro_steps += count

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return self._running(truth_values=False)

    @contextlib.contextmanager
    def _running(self, truth_values: bool = True) -> Iterator[None]:
        """While DeepSpeed runs the rank: what fake tensors need from it, and the linear it put in place.
        Under offload_optimizer the accelerator also tells the host's buffers from the GPU's, which on the CPU
        it cannot (ZeRO-3 accumulates a gradient on the GPU, brought over from its host buffer, only where
        `on_accelerator` says the buffer is not there: stage3.py, partition_grads)."""
        linear = torch.nn.functional.linear
        torch.nn.functional.linear = self._linear
        accelerator = cpu_accelerator()
        host = {StorageWeakRef(tensor.untyped_storage()) for tensor in self.host_tensors()}
        if host:
            accelerator.on_accelerator = lambda tensor: StorageWeakRef(tensor.untyped_storage()) not in host
        try:
            with (
                fake_tensors_tolerated(self.world_size, truth_values),
                autocast_globals(self._autocast),
                per_rank_loops_replaced(),
            ):
                yield
        finally:
            torch.nn.functional.linear = linear
            accelerator.__dict__.pop("on_accelerator", None)

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """The rank's float32 partitions (the inner optimizer's parameters; ZeRO-3 hands them to it only
        while it steps, stage3.py `_optimizer_step`) and their state."""
        inner = self.engine.optimizer.optimizer
        tensors = [param for group in inner.param_groups for param in group["params"]]
        tensors.extend(getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", []))
        for state in inner.state.values():
            tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
        return tensors

    def host_memory(
        self, gradients: list[torch.Tensor], optimizer_state: list[torch.Tensor], copies: Any
    ) -> HostMemory:
        """Under offload_optimizer, what the rank keeps in host memory (besides what its step makes there):
        the float32 master partitions and the optimizer's state (`optimizer_state`), the partitions'
        gradients, and the host buffers DeepSpeed stages gradients and parameters in. Stages 1 and 2
        (stage_1_and_2.py): a 16-bit copy of each partition the step writes before the GPU's
        (`param_buffer_of_bit16_for_cpu_offload_groups`), one parameter's gradient
        (`temp_grad_buffer_for_cpu_offload`), and with accumulation each parameter's gradient accumulated
        on the host (`accumulated_grads_in_cpu`). Stage 3 (stage3.py): the gradient partitions' flat buffer
        (`grad_partitions_flat_buffer`), and under offload_param the parameters' 16-bit partitions
        (`param_groups_fp16_flat_cpu_memory`). Pinned where DeepSpeed pins them (each section's `pin_memory`,
        on a GPU run). `gradients` (the model's 16-bit gradients, on the GPU) and `copies` (FSDP2's) are not
        its."""
        zero = self.engine.optimizer
        # Pinned (get_accelerator().pin_memory): stage 1 and 2's master partitions and every buffer above;
        # not the optimizer's state, which torch's optimizer makes (zeros_like), nor stage 3's master partitions.
        buffers = [*getattr(zero, "single_partition_of_fp32_groups", []), *self._host_buffers()]
        storages = {StorageWeakRef(tensor.untyped_storage()) for tensor in [*buffers, *optimizer_state]}
        parameters = {id(tensor) for tensor in self._parameters_on_host}
        pinned = {
            StorageWeakRef(tensor.untyped_storage())
            for tensor in buffers
            if (self._pins_parameters if id(tensor) in parameters else self.pins_host_memory)
        }
        return HostMemory(storages=frozenset(storages), pinned=frozenset(pinned), windows=tuple(self.host_windows))

    def host_tensors(self) -> list[torch.Tensor]:
        """Under offload_optimizer, every tensor the rank keeps in host memory (none otherwise)."""
        return [*self.optimizer_tensors(), *self._host_buffers()] if self.offload else []

    def _host_buffers(self) -> list[torch.Tensor]:
        """Under offload_optimizer, the host buffers DeepSpeed keeps besides the optimizer's parameters and
        state (host_memory); none otherwise."""
        if not self.offload:
            return []
        zero = self.engine.optimizer
        tensors = []
        for partition in [
            *getattr(zero, "single_partition_of_fp32_groups", []),
            *getattr(zero, "fp32_partitioned_groups_flat", []),
        ]:
            tensors.append(partition.grad)
        tensors.extend(getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", []))
        tensors.extend(getattr(zero, "accumulated_grads_in_cpu", {}).values())
        tensors.append(getattr(zero, "temp_grad_buffer_for_cpu_offload", None))
        if self.stage == 3:
            tensors.append(zero.grad_partitions_flat_buffer)
        tensors.extend(self._parameters_on_host)
        return [tensor for tensor in tensors if isinstance(tensor, torch.Tensor)]

    def buckets(self) -> list[torch.Tensor]:
        """The reduce buckets kept between steps: ZeRO-3's, made once (stage3.py, IPGBucketZ3.buffer);
        ZeRO-2 makes its own in each backward (noted_storages)."""
        buckets = getattr(self.engine.optimizer, "ipg_buckets", {}).values()
        return [bucket.buffer for bucket in buckets if isinstance(bucket.buffer, torch.Tensor)]

    def noted_storages(self) -> list[tuple[StorageWeakRef, int, str]]:
        """What DeepSpeed made and let go inside the traced step, by category: the reduce buckets,
        made at each backward's start and released at its end (`_release_ipg_buffers`), and the
        gradient partition the step reads; and what ZeRO-3 keeps beside the (empty) parameters: their
        16-bit partitions and the partitions' gradient buffer."""
        noted = [(key, nbytes, category) for key, (nbytes, category) in self._noted.items()]
        zero = self.engine.optimizer
        gradient_partitions = getattr(zero, "grad_partitions_flat_buffer", None)
        kept = [(flat, "parameters") for flat in getattr(zero, "fp16_partitioned_groups_flat", [])]
        kept.append((gradient_partitions, "gradients"))
        # Under offload_optimizer, stages 1 and 2 stage an accumulated gradient on its way back from the
        # host in a buffer of the largest parameter's size, made once on the GPU (stage_1_and_2.py).
        kept.append((getattr(zero, "temp_grad_buffer_for_gpu_offload", None), "gradients"))
        kept.extend((tensor, "optimizer") for tensor in self._host_buffers() if tensor is not gradient_partitions)
        for tensor, category in kept:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                noted.append((StorageWeakRef(storage), storage.nbytes(), category))
        return noted

    def _note_released_buckets(self) -> None:
        zero = self.engine.optimizer
        release = getattr(zero, "_release_ipg_buffers", None)
        if release is None or not hasattr(zero, "ipg_buckets"):
            return

        def noted_release() -> None:
            for bucket in zero.ipg_buckets.values():
                for buffer in bucket.buffer if isinstance(bucket.buffer, list) else []:
                    storage = buffer.untyped_storage()
                    self._noted[StorageWeakRef(storage)] = (storage.nbytes(), "communication")
            release()

        zero._release_ipg_buffers = noted_release

    def after_warm_up(self) -> None:
        return None

    def dropped_in_step(self) -> frozenset[int]:
        """The storages (C++ addresses) the traced iteration started with that DeepSpeed drops in it:
        ZeRO-2's gradients accumulated over the step's earlier micro-batches (`all_grad_tensors`),
        added into once more by the last micro-batch's backward and dropped at its end
        (stage_1_and_2.py, `independent_gradient_partition_epilogue`: `self.all_grad_tensors[i] = None`
        at the accumulation boundary); stage 1's gradients, reduced and dropped in the step; and stage 1's
        reduce bucket, made in the step's first backward (`setup_buckets`, only while not
        `ready_for_gradients`) and kept across its micro-batches to the boundary's epilogue
        (`_release_ipg_buffers`), where stage 2 makes and releases one in every micro-batch."""
        return self._accumulated

    def before_traced_iteration(self, node_clock: Callable[[], int]) -> None:
        self.host_windows.clear()
        self.node_clock = node_clock
        self._noted.clear()  # what the warm-up or an earlier trace noted is gone: only this step's count
        accumulated = [
            tensor
            for tensors in getattr(self.engine.optimizer, "all_grad_tensors", {}).values()
            for tensor in tensors or []
            if tensor is not None
        ]
        if self.stage == 1:  # stage 1 accumulates in the parameters' own gradients, reduced and dropped in the step
            accumulated += [param.grad for param in self.module.parameters() if param.grad is not None]
            accumulated += [
                buffer
                for bucket in getattr(self.engine.optimizer, "ipg_buckets", {}).values()
                for buffer in bucket.buffer
            ]
        self._accumulated = frozenset(tensor.untyped_storage()._cdata for tensor in accumulated)
        if self.stage == 3:
            # ZeRO-3's parameters gathered as the step starts: the persistent ones (the rest are empty)
            for param in self.module.parameters():
                storage = param.untyped_storage()
                if storage.nbytes():
                    self._noted[StorageWeakRef(storage)] = (storage.nbytes(), "unsharded_parameters")
