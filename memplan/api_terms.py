"""Error messages in the caller's own terms: the CLI's flags on the command line, keywords from Python.

memplan's checks are shared by both front-ends (the CLI calls memplan.api), and their messages name the
CLI's flags: "--batch-sizes takes positive integers", "pass --budget (e.g. 24GiB) or --gpu NAME". A Python
caller never typed a flag. So each API function rewords a MemplanError on its way out: every flag that has
an API keyword becomes that keyword, with the value the message gives it ("batch_sizes takes positive
integers", "pass budget (e.g. 24GiB) or gpu=NAME", "--device cuda" as "device='cuda'"). Flags without a
keyword (--json, --plot, --hf-args, ...) stay as they are. While the command line runs (memplan.cli's group
holds `command_line_terms()` for the command), messages keep the flags.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from memplan.distributed.modes import FSDP_MIXED_PRECISIONS, OFFLOAD_MODES, PARALLEL_MODES
from memplan.errors import MemplanError
from memplan.gpus import GPUS
from memplan.settings import (
    ATTENTION_IMPLEMENTATIONS,
    CHECKPOINT_MODES,
    DEVICES,
    LOOPS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    QUANT_TYPES,
    TrainingSettings,
)

_command_line = ContextVar("memplan_command_line_terms", default=False)
# A trace holds process-wide state (torch's dispatch modes, the collector's freeze, patched library functions,
# a fake process group): two calls from two threads at once gave one of them wrong figures. Calls from threads
# wait for each other; a call that makes another (validate_suite's validate) holds the lock already.
_one_call_at_a_time = threading.RLock()

# Flags whose keyword is not the flag with '-' as '_' (memplan.cli.options and each command's own options).
_RENAMED = {
    "cudnn-tf32": "cudnn_allow_tf32",
    "cudnn-workspace-cap": "cudnn_workspace_cap_mib",
    "deepspeed": "deepspeed_config",
    "lora": "lora_rank",
    "timeout": "timeout_s",
}

# Switches: the flag alone sets a bool keyword (click's `--x/--no-x` pairs and the flags of `is_flag=True`).
_SWITCHES = {
    "cudnn-benchmark": "cudnn_benchmark=True",
    "cudnn-tf32": "cudnn_allow_tf32=True",
    "no-cudnn-tf32": "cudnn_allow_tf32=False",
    "deterministic": "deterministic=True",
    "ddp-bucket-view": "ddp_bucket_view=True",
    "kbit-upcast": "kbit_upcast=True",
    "no-kbit-upcast": "kbit_upcast=False",
    "nccl-nvls": "nccl_nvls=True",
    "no-nccl-nvls": "nccl_nvls=False",
    "selective": "selective=True",
    "resume": "resume=True",
    "force": "replace=True",  # validate_suite's; the API writes no other file that exists (the CLI checks --plot...)
}

# Flags that are a thing of their own in the API: a function, a file that a function reads.
_FUNCTIONS = {"maximize-batch": "plan_batch", "hf-args": "TrainingArguments file"}

# The values a message may give a flag, by keyword: a word after a flag is its value only where it is one of
# these ("--device cuda"), not where it goes on with the sentence ("--checkpoint mode", "--budget or").
_CHOICES: dict[str, tuple[str, ...]] = {
    "precision": PRECISIONS,
    "precisions": PRECISIONS,
    "checkpoint": CHECKPOINT_MODES,
    "checkpoints": CHECKPOINT_MODES,
    "device": DEVICES,
    "optimizer": OPTIMIZERS,
    "optimizer_impl": OPTIMIZER_IMPLS,
    "loop": LOOPS,
    "attn_impl": ATTENTION_IMPLEMENTATIONS,
    "quantize": QUANT_TYPES,
    "parallel": PARALLEL_MODES,
    "offload": OFFLOAD_MODES,
    "fsdp_mixed_precision": FSDP_MIXED_PRECISIONS,
    "gpu": tuple(GPUS),
    "maximize": ("seq-len",),
}

_FLAG = re.compile(r"(?<![\w-])--(?P<flag>[a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?: (?P<value>'[^']*'|[\w.-]*\w))?")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")
_PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*")  # NAME, N, RANK

Wrapped = TypeVar("Wrapped", bound=Callable[..., Any])


@contextmanager
def command_line_terms() -> Iterator[None]:
    """While held, messages keep the CLI's flags (memplan.cli's group holds it for each command)."""
    token = _command_line.set(True)
    try:
        yield
    finally:
        _command_line.reset(token)


def speaks_command_line() -> bool:
    """Whether the command line called: a message whose flag and keyword differ in more than spelling (--gpu
    T4,L4 is which_gpu's gpus=) names the one its reader typed."""
    return _command_line.get()


@functools.cache
def _keywords() -> frozenset[str]:
    """Every keyword a Python caller can give: the settings and the API functions' own arguments."""
    import memplan.api as api

    arguments = {
        name
        for function in (getattr(api, name) for name in api.__all__)
        for name in inspect.signature(function).parameters
    }
    return frozenset(TrainingSettings.__dataclass_fields__) | arguments


def _keyword_form(match: re.Match[str]) -> str:
    flag, value = match.group("flag"), match.group("value")
    if flag in _SWITCHES or flag in _FUNCTIONS:
        # a switch takes no value: a word after it goes on with the sentence ("pass --resume to continue")
        return (_SWITCHES.get(flag) or _FUNCTIONS[flag]) + ("" if value is None else f" {value}")
    keyword = _RENAMED.get(flag, flag.replace("-", "_"))
    if keyword not in _keywords():
        return match.group(0)
    if value is None:
        return keyword
    if value in _CHOICES.get(keyword, ()) or (value[0].isdigit() and not _NUMBER.fullmatch(value)):
        return f"{keyword}={value!r}"  # one of the keyword's choices, or a size ('24GiB')
    if value.startswith("'") or _NUMBER.fullmatch(value) or _PLACEHOLDER.fullmatch(value):
        return f"{keyword}={value}"  # quoted already, a number, or a placeholder
    return f"{keyword} {value}"  # the sentence goes on


def in_api_terms(message: str) -> str:
    """The message with each flag that has an API keyword written as that keyword (see the module's doc)."""
    return _FLAG.sub(_keyword_form, message)


def _reworded(error: MemplanError) -> MemplanError:
    if not _command_line.get() and error.args and isinstance(error.args[0], str):
        error.args = (in_api_terms(error.args[0]), *error.args[1:])
    return error


def _reworded_items(items: Iterator[Any]) -> Iterator[Any]:
    try:
        yield from items
    except MemplanError as error:
        _reworded(error)
        raise


def speaks_api_terms(function: Wrapped) -> Wrapped:
    """`function`'s MemplanErrors, and the notes of the result it returns, worded in the API's keywords unless
    the command line called it; a function that returns an iterator (validate_suite) has the errors its
    iteration raises reworded as well. Its arguments' numbers are Python's own (plain_numbers). Calls from
    several threads run one at a time."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(plain_numbers(value) for value in args)
        kwargs = {name: plain_numbers(value) for name, value in kwargs.items()}
        try:
            with _one_call_at_a_time:
                returned = function(*args, **kwargs)
        except MemplanError as error:
            _reworded(error)
            raise
        if inspect.isgenerator(returned):
            return _reworded_items(returned)
        return _with_notes_reworded(returned)

    return wrapper  # type: ignore[return-value]


def plain_numbers(value: Any) -> Any:
    """An argument with numpy's (or any library's) integers as Python ints, and a one-dimensional array as a
    list: `batch_size=np.int64(2)` and `batch_sizes=np.arange(1, 9)` are what a loop over a numpy range or a
    pandas column gives, and the checks take ints ("batch size must be a positive integer, got np.int64(2)").
    bool and float values stay what they are, as the checks refuse them."""
    if isinstance(value, numbers.Integral) and not isinstance(value, int | bool):
        return int(value)
    if type(value) in (list, tuple):  # not a named tuple or other subclass, whose constructor differs
        return type(value)(plain_numbers(item) for item in value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 1:
        return [plain_numbers(item) for item in value.tolist()]
    return value


def _with_notes_reworded(result: Any) -> Any:
    """A result whose `notes` (EstimateResult's: "give yours with --cuda-context") speak the caller's terms, and
    so do those of the results inside it (which_gpu's and compare's estimates, row by row)."""
    return result if _command_line.get() else _notes_reworded(result)


def _notes_reworded(value: Any) -> Any:
    if type(value) in (tuple, list):
        items = [_notes_reworded(item) for item in value]
        return type(value)(items) if any(new is not old for new, old in zip(items, value, strict=True)) else value
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    changes = {}
    for field in dataclasses.fields(value):
        if field.name == "timeline" or not field.init:  # a step's allocations hold no notes
            continue
        current = getattr(value, field.name)
        if field.name == "notes" and isinstance(current, tuple):
            changed = tuple(in_api_terms(note) if isinstance(note, str) else note for note in current)
        else:
            changed = _notes_reworded(current)
        if changed is not current and changed != current:
            changes[field.name] = changed
    return dataclasses.replace(value, **changes) if changes else value
