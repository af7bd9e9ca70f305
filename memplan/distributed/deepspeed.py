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
section, bucket sizes, `overlap_comm`, `contiguous_gradients`) is DeepSpeed's to apply too.

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
import importlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import patch

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.distributed.deepspeed_file import AUTOCAST_DTYPE_NAMES, AUTOCAST_SECTION
from memplan.distributed.offload import HostCopies, HostMemory
from memplan.errors import SettingsError
from memplan.settings import DEEPSPEED_MODE_OF_STAGE

# Keys of a DeepSpeed configuration that memplan's own settings decide (batch, accumulation,
# precision, optimizer): the user's values for them are replaced.
MEMPLAN_SETS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "bf16",
    "bfloat16",  # bf16's older name, which DeepSpeed still reads
    "fp16",
    "torch_autocast",
    "zero_allow_untested_optimizer",
)
# transformers' HfDeepSpeedConfig fills "auto" sizes from the model's hidden size
# (integrations/deepspeed.py, trainer_config_finalize): reduce_bucket_size = hidden_size², and with
# stage 3 stage3_prefetch_bucket_size = int(0.9 × hidden_size²), stage3_param_persistence_threshold =
# 10 × hidden_size.
AUTO_FROM_HIDDEN_SIZE = {
    "reduce_bucket_size": lambda hidden: hidden * hidden,
    "stage3_prefetch_bucket_size": lambda hidden: int(0.9 * hidden * hidden),
    "stage3_param_persistence_threshold": lambda hidden: 10 * hidden,
}


def deepspeed_config(
    stage: int,
    batch_size: int,
    precision: str,
    user_config: dict[str, Any] | None,
    hidden_size: int | None = None,
    grad_accum: int = 1,
    offload: str = "none",
) -> dict:
    """The configuration the rank's engine is built with: the user's (`--deepspeed`), with the ZeRO
    stage, batch, accumulation, precision (torch_autocast for amp-*, its module list the user's) and
    optimizer set from memplan's settings, the
    "auto" values transformers would fill, and `offload_optimizer` on the host where `offload` is
    "optimizer" (--offload optimizer)."""
    config = {key: value for key, value in (user_config or {}).items() if key not in MEMPLAN_SETS}
    zero = dict(config.get("zero_optimization") or {})
    for key, value in list(zero.items()):
        if value != "auto":
            continue
        if key.startswith("stage3_") and (stage != 3 or key not in AUTO_FROM_HIDDEN_SIZE):
            del zero[key]  # stage 3's settings that size no buffer (or a stage that reads none): DeepSpeed's default
        elif key in AUTO_FROM_HIDDEN_SIZE and hidden_size is not None:
            zero[key] = AUTO_FROM_HIDDEN_SIZE[key](hidden_size)
        else:
            raise SettingsError(
                f'--deepspeed: zero_optimization.{key} is "auto", which transformers fills from the model\'s '
                "config and memplan cannot here: give a number"
            )
    offload_optimizer = _offload_optimizer(zero, offload)
    if offload_optimizer is not None:
        zero["offload_optimizer"] = offload_optimizer
        # memplan's optimizer is the client optimizer, which DeepSpeed runs on the host when told it may
        # (engine.py, _configure_optimizer: DeepSpeedCPUAdam is required otherwise); where the job would run
        # DeepSpeedCPUAdam, the rank runs memplan's optimizer as it (DeepSpeedRank, runs_deepspeed_cpu_adam).
        config["zero_force_ds_cpu_optimizer"] = False
    offload_param = _offload_param(zero, offload, stage, offload_optimizer is not None)
    if offload_param is not None:
        zero["offload_param"] = offload_param
    zero["stage"] = stage
    config["zero_optimization"] = zero
    config["train_micro_batch_size_per_gpu"] = batch_size
    config["gradient_accumulation_steps"] = grad_accum  # the engine counts the micro-batches (after_micro_batch)
    config["bf16"] = {"enabled": precision == "bf16"}
    # fp16: DeepSpeed's own, a 16-bit model, float32 master partition and a dynamic loss scale (a
    # Python number it multiplies the loss by and divides the gradients by in the step).
    config["fp16"] = {"enabled": precision == "fp16"}
    if precision in AUTOCAST_DTYPE_NAMES:
        user_autocast = (user_config or {}).get(AUTOCAST_SECTION)
        config[AUTOCAST_SECTION] = {
            **(user_autocast if isinstance(user_autocast, dict) else {}),
            "enabled": True,
            "dtype": AUTOCAST_DTYPE_NAMES[precision],
        }
    # memplan hands DeepSpeed its optimizer as the client optimizer, as transformers' Trainer does, which
    # then allows optimizers DeepSpeed has not tested with ZeRO (integrations/deepspeed.py,
    # deepspeed_optim_sched): without it torch's Adafactor or bitsandbytes' 8-bit Adam fail an assertion.
    config["zero_allow_untested_optimizer"] = True
    return config


def runs_deepspeed_cpu_adam(user_config: dict[str, Any] | None) -> bool:
    """Whether a job offloading its optimizer steps with DeepSpeedCPUAdam: DeepSpeed requires it (or its
    CPU Adagrad or Lion) with offload_optimizer unless the configuration says `zero_force_ds_cpu_optimizer:
    false` (engine.py, _configure_optimizer), accelerate, and so transformers' Trainer, turns the
    Trainer's torch optimizer into it (accelerate/utils/deepspeed.py, map_pytorch_optim_to_deepspeed:
    DeepSpeedCPUAdam for all but Adagrad and bitsandbytes' 32-bit Lion), and DeepSpeed builds it from an
    "optimizer" section of the file."""
    return (user_config or {}).get("zero_force_ds_cpu_optimizer", True) is not False


def _as_deepspeed_cpu_adam(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer` steps as DeepSpeedCPUAdam does (deepspeed/ops/adam/cpu_adam.py, `step`): each parameter's
    state made once, `exp_avg` and `exp_avg_sq` in float32 (fp32_optimizer_states, its default) like the
    parameter, and the update done in place by its C++ kernel, which allocates no tensor."""

    def step(closure: Any = None) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = optimizer.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param.data, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(param.data, dtype=torch.float)
                state["step"] += 1

    optimizer.step = step  # type: ignore[method-assign]


def _offload_section(zero: dict[str, Any], name: str, forced: bool, moved: str) -> dict[str, Any] | None:
    """zero_optimization's `name` section ("offload_param" or "offload_optimizer") as the rank runs it: the
    user's, its device set to "cpu" where `forced` (by --offload); None where nothing leaves the GPU.
    NVMe (ZeRO-Infinity's swapping) is refused: memplan does not trace it."""
    section = dict(zero.get(name) or {})
    if forced:
        section["device"] = "cpu"
    device = section.get("device") or "none"
    if device == "none":
        return None
    if device != "cpu":
        raise SettingsError(
            f'--deepspeed: zero_optimization.{name} moves {moved} to "{device}" (ZeRO-Infinity), which memplan '
            f'does not trace: give "cpu", or remove {name}'
        )
    return section


def _offload_param(zero: dict[str, Any], offload: str, stage: int, offloads_optimizer: bool) -> dict[str, Any] | None:
    """The offload_param section: ZeRO-3's parameter partitions on the host, set by --offload params with the
    optimizer's state (the usual "ZeRO-3 offload" configuration)."""
    section = _offload_section(zero, "offload_param", offload == "params", "the parameters")
    if section is None:
        return None
    if stage != 3:
        raise SettingsError("--deepspeed: zero_optimization.offload_param is ZeRO-3's: give --parallel zero3")
    if not offloads_optimizer:
        raise SettingsError(
            "--deepspeed: zero_optimization.offload_param without offload_optimizer is not traced: offload both "
            '(device "cpu" in each, or --offload params)'
        )
    return section


def _offload_optimizer(zero: dict[str, Any], offload: str) -> dict[str, Any] | None:
    """The offload_optimizer section, set by --offload optimizer (and params). A partial offload (`ratio`
    below 1, which keeps some sub-groups' state on the GPU, or `super_offload`) is refused."""
    section = _offload_section(zero, "offload_optimizer", offload in ("optimizer", "params"), "the optimizer state")
    if section is not None and (float(section.get("ratio", 1.0)) != 1.0 or section.get("super_offload")):
        raise SettingsError(
            "--deepspeed: zero_optimization.offload_optimizer offloads part of the optimizer (ratio below 1, or "
            "super_offload), which memplan does not trace: leave them out for the whole state on the host"
        )
    return section


@contextlib.contextmanager
def _config_errors_in_one_line() -> Iterator[None]:
    """DeepSpeed checks its configuration's sections with pydantic models (runtime/config_utils.py,
    DeepSpeedConfigModel: typed, bounded fields, unknown keys refused): a value it refuses is the user's
    mistake, said in one line with where it is, not pydantic's multi-line report."""
    from pydantic import ValidationError

    try:
        yield
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        raise SettingsError(
            f"the DeepSpeed configuration: DeepSpeed's {error.title} refuses {where or 'a value'}: {first['msg']} "
            f"(given {first.get('input')!r}){more}"
        ) from error
    except ValueError as error:
        # torch_autocast's lower_precision_safe_modules: class paths DeepSpeed imports (torch_autocast.py,
        # init_autocast_params: "Failed to import lower precision safe module ...").
        if "lower precision safe module" not in str(error):
            raise
        raise SettingsError(
            f"the DeepSpeed configuration's torch_autocast.lower_precision_safe_modules: {error} (give module "
            "classes as package.module.Class, importable where memplan runs)"
        ) from error


def _import_deepspeed() -> Any:
    """deepspeed, imported with its log handler moved to stderr: DeepSpeed logs to stdout (a
    StreamHandler made at import, deepspeed/utils/logging.py), where it would break `--json`. What it
    says while it is imported (which accelerator it detected) is dropped; its messages while memplan
    drives it are quietened to errors (_fake_tensors_tolerated)."""
    first_import = "deepspeed" not in sys.modules
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import deepspeed
    except ImportError as error:
        raise SettingsError(
            f"--parallel zero2/zero3 (and zero1 with --deepspeed) trace DeepSpeed's own ZeRO, which is not "
            f"installed ({error}): pip install deepspeed (or memplan[deepspeed])"
        ) from error
    if first_import:
        from deepspeed.utils.logging import logger

        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setStream(sys.stderr)
    return deepspeed


def _fresh_fake_group(world_size: int, option: str) -> None:
    """A fake default group of `world_size` ranks for DeepSpeed, its own cached groups forgotten."""
    import deepspeed.comm.comm as deepspeed_comm
    import deepspeed.utils.groups as groups

    from memplan.distributed.fake_group import lingering_fake_group

    lingering_fake_group(world_size, option)
    deepspeed_comm.cdb = None
    groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups.mesh_device = None


@functools.cache
def _cpu_accelerator() -> Any:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    # It offers fp16 only where the CPU has oneDNN's fp16 kernels (cpu_accelerator.py, is_fp16_supported);
    # the job's GPUs have fp16, and fake tensors run it as they run any dtype.
    accelerator.is_fp16_supported = lambda: True
    return accelerator


@contextlib.contextmanager
def _fake_tensors_tolerated(world_size: int, truth_values: bool = True) -> Iterator[None]:
    """What DeepSpeed reads of values, answered without them (module docstring), and the launcher's
    variables it reads (rank 0 of `world_size`) set meanwhile. `truth_values=False` leaves a fake
    tensor's truth value unanswered (the model's forward: its own code must not be steered by it)."""
    # (`import deepspeed.comm.torch as ...` would bind torch itself: deepspeed.comm has an attribute `torch`)
    deepspeed_torch_backend = importlib.import_module("deepspeed.comm.torch")
    import deepspeed.runtime.zero.partition_parameters as partition_parameters
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.utils as zero_utils
    from torch._subclasses.fake_tensor import FakeTensor

    saved: list[tuple[Any, str, Any]] = [
        (deepspeed_torch_backend, "build_shm_op", deepspeed_torch_backend.build_shm_op)
    ]
    deepspeed_torch_backend.build_shm_op = lambda: None  # a shared-memory kernel for real CPU collectives
    # Stage 3 asserts that every rank sees the same counts (all-reduced values: none on a fake group);
    # each module imports the check by name.
    for owner in (zero_utils, coordinator, stage3, partition_parameters):
        saved.append((owner, "assert_ints_same_as_other_ranks", owner.assert_ints_same_as_other_ranks))
        owner.assert_ints_same_as_other_ranks = _same_on_every_rank
    # The step skips itself where the gradients' norm is inf or nan (`is_invalid_grad_norm`, imported by name
    # into stage3.py and stage_1_and_2.py). A fake group's collectives write nothing, so in a real run on it
    # (validate) a bucket's unwritten memory can make the norm so, and the step, its optimizer state with it,
    # is skipped; a healthy step's norm is valid. The check runs (its temporaries count) and says so.
    import deepspeed.runtime.zero.stage_1_and_2 as stage_1_and_2

    for owner in (stage3, stage_1_and_2):
        if hasattr(owner, "is_invalid_grad_norm"):
            saved.append((owner, "is_invalid_grad_norm", owner.is_invalid_grad_norm))
            owner.is_invalid_grad_norm = _valid_after_checking(owner.is_invalid_grad_norm)
    if truth_values:
        saved.append((FakeTensor, "__bool__", FakeTensor.__dict__.get("__bool__")))
        FakeTensor.__bool__ = lambda self: False  # type: ignore[method-assign]
        # Stage 3's host gradient norm under offload_optimizer reads a norm with float() (stage3.py,
        # complete_grad_norm_calculation_for_cpu_offload): a number it only computes with.
        saved.append((FakeTensor, "__float__", FakeTensor.__dict__.get("__float__")))
        FakeTensor.__float__ = lambda self: 1.0  # type: ignore[method-assign]
    from deepspeed.accelerator import real_accelerator

    # DeepSpeed runs its CPU accelerator over fake CPU tensors (the allocations are the same ops),
    # whatever accelerator the process has chosen, which it gets back afterwards.
    saved.append((real_accelerator, "ds_accelerator", real_accelerator.ds_accelerator))
    real_accelerator.ds_accelerator = _cpu_accelerator()
    from deepspeed.utils.logging import logger

    level = logger.level
    logger.setLevel(logging.ERROR)  # its notices (accelerator, config, a skipped step) are not the user's
    launcher = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size)}
    try:
        with patch.dict(os.environ, launcher), warnings.catch_warnings():
            # DeepSpeed reads data_ptr() for alignment asserts (fake tensors warn that it is deprecated for
            # them) and calls torch.distributed's deprecated all_gather_into_tensor: neither is the user's.
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor", category=UserWarning)
            warnings.filterwarnings("ignore", message=".*all_gather_into_tensor", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor", category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)
        for owner, name, original in saved:
            if original is None and owner is FakeTensor:  # __bool__, __float__: FakeTensor had none of its own
                delattr(owner, name)
            else:
                setattr(owner, name, original)


# DeepSpeed's torch_autocast keeps its state in module globals (runtime/torch_autocast.py: whether an engine
# initialized it, and its dtype), set by an engine's initialize and read as its ZeRO optimizer is built and as
# it reduces each gradient (base_optimizer.py, get_param_comm_dtype). Each rank's are its own, set while it runs;
# the process's are restored between.
_AUTOCAST_GLOBALS = ("TORCH_AUTOCAST_INITIALIZED", "TORCH_AUTOCAST_DTYPE")
_NO_AUTOCAST: dict[str, Any] = {"TORCH_AUTOCAST_INITIALIZED": False, "TORCH_AUTOCAST_DTYPE": None}


@contextlib.contextmanager
def _autocast_globals(values: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """DeepSpeed's torch_autocast globals set to `values` meanwhile; yields the values they hold as the block
    ends (what an engine's initialize made of them), and restores the process's."""
    import deepspeed.runtime.torch_autocast as torch_autocast

    saved = {name: getattr(torch_autocast, name) for name in _AUTOCAST_GLOBALS}
    held = dict(values)
    for name, value in values.items():
        setattr(torch_autocast, name, value)
    try:
        yield held
    finally:
        held.update({name: getattr(torch_autocast, name) for name in _AUTOCAST_GLOBALS})
        for name, value in saved.items():
            setattr(torch_autocast, name, value)


def _valid_after_checking(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def valid(norm: Any) -> bool:
        check(norm)
        return False

    return valid


def _same_on_every_rank(*_: Any, **__: Any) -> None:
    return None  # what rank 0 sees is what every rank of a fake group sees


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
        deepspeed = _import_deepspeed()
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
        _fresh_fake_group(world_size, option)
        linear = torch.nn.functional.linear
        try:
            with (
                _fake_tensors_tolerated(self.world_size),
                _config_errors_in_one_line(),
                _autocast_globals(_NO_AUTOCAST) as self._autocast,
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
                _as_deepspeed_cpu_adam(zero.optimizer)
            self._timed_on_host(zero.optimizer, "step")
            self._timed_on_host(zero, "complete_grad_norm_calculation_for_cpu_offload")
        self._noted: dict[StorageWeakRef, tuple[int, str]] = {}
        self._accumulated: frozenset[int] = frozenset()
        self._note_released_buckets()
        self._no_overflow()

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
        accelerator = _cpu_accelerator()
        host = {StorageWeakRef(tensor.untyped_storage()) for tensor in self.host_tensors()}
        if host:
            accelerator.on_accelerator = lambda tensor: StorageWeakRef(tensor.untyped_storage()) not in host
        try:
            with _fake_tensors_tolerated(self.world_size, truth_values), _autocast_globals(self._autocast):
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

    def _no_overflow(self) -> None:
        """The overflow check runs (its temporaries count) and finds none, as in a healthy step: it
        reads its verdict with `.item()` on a byte tensor, which fake tensors have no value for (with
        bf16 and fp16 it would otherwise skip every step, and the optimizer state would never exist); torch's
        GradScaler, which the ZeRO optimizers step through under torch_autocast in float16, likewise."""
        zero = self.engine.optimizer
        check = getattr(zero, "has_overflow", None)
        if check is not None:

            def has_overflow(*args: Any, **kwargs: Any) -> bool:
                check(*args, **kwargs)
                return False

            zero.has_overflow = has_overflow
        scaler = getattr(zero, "torch_autocast_gradscaler", None)
        if scaler is not None:
            # torch_autocast in float16: the ZeRO optimizer steps through torch's GradScaler, which reads its
            # found-inf flags with `.item()` and skips the step where one is set (grad_scaler.py, _maybe_opt_step).
            def maybe_opt_step(optimizer: Any, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
                for found_inf in optimizer_state["found_inf_per_device"].values():
                    found_inf.item()
                return optimizer.step(*args, **kwargs)

            scaler._maybe_opt_step = maybe_opt_step

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
