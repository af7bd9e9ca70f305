"""What DeepSpeed needs to run one rank over fake tensors on torch's fake process group
(memplan.distributed.deepspeed): its import (its log moved off stdout), a fresh fake group with its own cached
groups forgotten, its CPU accelerator, answers to the value checks fake tensors cannot make (overflow, the
gradient norm, cross-rank consistency), its autocast globals per rank, its configuration errors in one line, and
a stand-in for DeepSpeedCPUAdam's C++ step.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import patch

import torch

from memplan.errors import SettingsError
from memplan.estimator.fake_mode import steps_finding_no_inf


@contextlib.contextmanager
def config_errors_in_one_line() -> Iterator[None]:
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
    except AssertionError as error:
        # DeepSpeed checks combinations of settings with asserts as it builds the engine ("pre-scale gradients is
        # not yet supported with ZeRO-2 with reduce scatter enabled", stage_1_and_2.py): said by DeepSpeed's own
        # code and with a reason, the configuration's mistake; any other assert stays an internal error.
        frame = error.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        said = str(error).strip()
        package = (
            os.path.dirname(sys.modules["deepspeed"].__file__ or "") + os.sep if "deepspeed" in sys.modules else None
        )
        if frame is None or not said or package is None or not frame.tb_frame.f_code.co_filename.startswith(package):
            raise
        raise SettingsError(f"the DeepSpeed configuration: DeepSpeed refuses it: {said.splitlines()[0]}") from error
    except ValueError as error:
        # torch_autocast's lower_precision_safe_modules: class paths DeepSpeed imports (torch_autocast.py,
        # init_autocast_params: "Failed to import lower precision safe module ...").
        if "lower precision safe module" not in str(error):
            raise
        raise SettingsError(
            f"the DeepSpeed configuration's torch_autocast.lower_precision_safe_modules: {error} (give module "
            "classes as package.module.Class, importable where memplan runs)"
        ) from error


def import_deepspeed() -> Any:
    """deepspeed, imported with its log handler moved to stderr: DeepSpeed logs to stdout (a
    StreamHandler made at import, deepspeed/utils/logging.py), where it would break `--json`. What it
    says while it is imported (which accelerator it detected) is dropped; its messages while memplan
    drives it are quietened to errors (fake_tensors_tolerated)."""
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


def fresh_fake_group(world_size: int, option: str) -> None:
    """A fake default group of `world_size` ranks for DeepSpeed, its own cached groups forgotten."""
    import deepspeed.comm.comm as deepspeed_comm
    import deepspeed.utils.groups as groups

    from memplan.distributed.fake_group import lingering_fake_group

    lingering_fake_group(world_size, option)
    deepspeed_comm.cdb = None
    groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups.mesh_device = None


@functools.cache
def cpu_accelerator() -> Any:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    # It offers fp16 only where the CPU has oneDNN's fp16 kernels (cpu_accelerator.py, is_fp16_supported);
    # the job's GPUs have fp16, and fake tensors run it as they run any dtype.
    accelerator.is_fp16_supported = lambda: True
    return accelerator


@contextlib.contextmanager
def fake_tensors_tolerated(world_size: int, truth_values: bool = True) -> Iterator[None]:
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
    real_accelerator.ds_accelerator = cpu_accelerator()
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
NO_AUTOCAST: dict[str, Any] = {"TORCH_AUTOCAST_INITIALIZED": False, "TORCH_AUTOCAST_DTYPE": None}


@contextlib.contextmanager
def autocast_globals(values: dict[str, Any]) -> Iterator[dict[str, Any]]:
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


def answer_no_overflow(zero: Any) -> None:
    """ZeRO's optimizer `zero`: its overflow check runs (its temporaries count) and finds none, as in a healthy step: it
    reads its verdict with `.item()` on a byte tensor, which fake tensors have no value for (with
    bf16 and fp16 it would otherwise skip every step, and the optimizer state would never exist); torch's
    GradScaler, which the ZeRO optimizers step through under torch_autocast in float16, likewise."""
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
        scaler._maybe_opt_step = types.MethodType(steps_finding_no_inf, scaler)


def as_deepspeed_cpu_adam(optimizer: torch.optim.Optimizer) -> None:
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
