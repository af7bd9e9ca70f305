"""What every command does around its one library call: errors and exit codes, progress, the
consoles, --hf-args and the environment's settings, JSON or tables (the output paths are checked in
memplan.cli.output_paths, the collector set in memplan.cli.collector)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from memplan import interrupts
from memplan.cli.collector import collect_before_teardown, collect_less, collector_held
from memplan.cli.options import _quiet
from memplan.compat import require_supported_torch
from memplan.errors import MemplanError, UsageError
from memplan.interrupts import deferred, reliable_interrupts

_ACTIVE_PROGRESS: list[Any] = []  # rich Status spinners on stderr, stopped before anything else prints


def _stop_progress() -> None:
    while _ACTIVE_PROGRESS:
        _ACTIVE_PROGRESS.pop().stop()


def _stderr_console():
    """Messages: stderr, colour only on a terminal (rich's default), silent under --quiet."""
    from rich.console import Console

    _stop_progress()
    return Console(stderr=True, highlight=False, quiet=_quiet())


def _stdout_console():
    """Tables for the terminal's width; piped or redirected, 120 columns rather than rich's 80."""
    from rich.console import Console

    _stop_progress()
    return Console(highlight=False, width=None if sys.stdout.isatty() else 120)


def _show_debug_messages() -> None:
    """memplan's own debug log (why planning ran in one process, ...) on stderr, once per process."""
    logger = logging.getLogger("memplan")
    logger.setLevel(logging.DEBUG)
    if not any(getattr(handler, "memplan_debug", False) for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.memplan_debug = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


_BITSANDBYTES_CPU_OPS = "bitsandbytes.backends.cpu.ops"


class _NoCpuKernelWarning(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


def _run(debug: bool, action: Callable[[], None]) -> None:
    """Turn MemplanError into one line on stderr and its exit code; tracebacks only with --debug.

    The exit happens after the except clauses: exiting inside one would keep the exception, and
    through its traceback every frame of the interrupted work, alive until the interpreter shuts
    down, whose teardown then fails in those objects' finalizers (torch's StorageWeakRef.__del__
    printed "Exception ignored ..." after "memplan: interrupted").
    """
    if debug:
        _show_debug_messages()
    # bitsandbytes warns at import, on CPUs with AVX-512 BF16, that its CPU kernel package is missing
    # (backends/cpu/ops.py): about the machine memplan traces on, not the user's job; its other messages show
    cpu_ops = logging.getLogger(_BITSANDBYTES_CPU_OPS)
    if not any(isinstance(known, _NoCpuKernelWarning) for known in cpu_ops.filters):
        cpu_ops.addFilter(_NoCpuKernelWarning())
    message, code = None, 0
    try:
        try:
            with reliable_interrupts():
                # imports torch: an interrupt must not land inside its C++ initialisers
                with deferred(), collector_held():
                    require_supported_torch()
                    import torch  # noqa: F401  (also where MEMPLAN_ALLOW_UNSUPPORTED_TORCH skips the check)
                collect_less()
                action()
        finally:
            _stop_progress()
    except KeyboardInterrupt:
        message, code = "memplan: interrupted", 130
    except Exception as error:
        if debug:
            traceback.print_exc()
        if interrupts.seen:  # raised while Ctrl-C unwound the work: the interrupt is the news
            message, code = "memplan: interrupted", 130
        elif isinstance(error, MemplanError):
            message, code = f"memplan: error: {error}", error.exit_code
        elif isinstance(error, OSError) and error.errno in FULL_DISK_ERRORS:  # printing the answer (`> /dev/full`)
            message, code = cannot_write(error), 1
        else:  # a bug in memplan or torch: say so, keep the details for --debug
            rerun = "" if debug else " (rerun with --debug)"
            message, code = f"memplan: internal error: {type(error).__name__}: {error}{rerun}", 1
    if message is not None:
        collect_before_teardown()
        click.echo(message, err=True)
        sys.exit(code)


# What writing the answer to a full or failing disk raises (files memplan writes say so as OutputError).
FULL_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def cannot_write(error: OSError) -> str:
    return f"memplan: error: cannot write the answer: {error.strerror}"


def _run_cached(command: str, debug: bool, action: Callable[[], None]) -> None:
    """_run, answered from memplan's cache when this command with these options has been answered
    before (memplan.cli.cache: before torch is imported), and kept there when it succeeds."""
    from click.core import ParameterSource

    from memplan.cli.cache import cached_answer

    context = click.get_current_context()
    # With --hf-args a flag given outright overrides the file even at its default value (_with_hf_args): which
    # flags were given is part of the question then.
    typed = {
        name for name in context.params if context.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
    }
    answer = cached_answer(command, context.params, typed)
    if answer is None:
        _run(debug, action)
        return
    try:
        replayed = answer.replay()
    except OSError as error:  # not through _run, which would import torch
        if error.errno not in FULL_DISK_ERRORS or debug:
            raise
        click.echo(cannot_write(error), err=True)
        sys.exit(1)
    if replayed:
        return

    def recorded() -> None:
        with answer.recorded():
            action()

    _run(debug, recorded)


def _with_hf_args(settings: dict[str, Any], as_json: bool) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Settings from --hf-args under the flags the user typed (a flag left at its default does not count), and
    the file's notes (what memplan does not model of it), which the text output has printed already."""
    from click.core import ParameterSource

    path = settings.pop("hf_args", None)
    if path is None:
        return settings, ()
    from memplan.hf_args import read_training_args

    context = click.get_current_context()

    def typed(name: str) -> bool:
        return context.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)

    loaded = read_training_args(
        path,
        read_optim=not typed("optimizer"),
        world_size_given=typed("world_size"),
        deepspeed_given=typed("deepspeed_config"),
        device=settings.get("device") or "cuda",
    )
    context_name = context.info_name
    if context_name == "plan":
        loaded.settings.pop("checkpoint", None)  # plan chooses the checkpointing itself
    if settings.get("step") is not None:
        loaded.settings.pop("loop", None)  # the user's own iteration replaces the Trainer's loop the file implies
        loaded.settings.pop("label_smoothing", None)  # and its loss
    elif typed("loop") and settings.get("loop") != "hf-trainer" and "label_smoothing" in loaded.settings:
        # another loop than the Trainer's, given as a flag, replaces the Trainer's loss too
        del loaded.settings["label_smoothing"]
        loaded = dataclasses.replace(
            loaded, notes=(*loaded.notes, f"--loop {settings.get('loop')}: the file's label_smoothing_factor is the "
                           "Trainer's loss, left out with its loop")
        )  # fmt: skip
    if context_name == "sweep" or context.params.get("maximize_batch"):
        loaded.settings.pop("batch_size", None)  # these commands choose the batch sizes themselves
    from_file = {key: value for key, value in loaded.settings.items() if not typed(key)}
    merged = {**settings, **from_file}
    if not as_json:
        console = _stderr_console()
        taken = ", ".join(f"{key}={value}" for key, value in from_file.items()) or "nothing (flags override it all)"
        console.print(f"[dim]from {path}: {taken}[/dim]")
        for note in loaded.notes:
            console.print(f"[dim]note: {note}[/dim]")
    return merged, tuple(loaded.notes)


# Options a CUDA library's or NCCL's own environment variable also sets (click's envvar=): the
# variables, the option's default, and whether it means something only on a data-parallel rank
# (NCCL's size its buffers there, memplan.distributed.nccl).
_ENVIRONMENT_OPTIONS: dict[str, tuple[tuple[str, ...], Any, bool]] = {
    "cudnn_workspace_cap_mib": (("CUDNN_CONV_WSCAP_DBG",), None, False),
    "cublas_workspace_config": (("CUBLAS_WORKSPACE_CONFIG",), None, False),
    "cuda_alloc_conf": (("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"), None, False),
    "nccl_buffsize": (("NCCL_BUFFSIZE",), None, True),
    "nccl_max_ctas": (("NCCL_MAX_CTAS", "NCCL_MAX_NCHANNELS"), None, True),
    "nccl_nvls": (("NCCL_NVLS_ENABLE",), True, True),
}


def _with_environment(settings: dict[str, Any], as_json: bool) -> dict[str, Any]:
    """Say which settings came from the environment; a CUDA variable means nothing for a cpu target,
    an NCCL one nothing for one process either."""
    from click.core import ParameterSource

    context = click.get_current_context()
    for name, (variables, default, data_parallel_only) in _ENVIRONMENT_OPTIONS.items():
        if context.get_parameter_source(name) != ParameterSource.ENVIRONMENT:
            continue
        one_process = settings.get("parallel", "none") == "none"
        if settings.get("device") == "cpu" or (data_parallel_only and one_process):
            settings[name] = default
        elif not as_json and not _quiet():
            variable = next(variable for variable in variables if variable in os.environ)
            _stderr_console().print(f"[dim]from the environment: {variable}={os.environ[variable]}[/dim]")
    return settings


def _call(function: Callable[..., Any], model: str, settings: dict[str, Any], as_json: bool, **options: Any) -> Any:
    """One library call with the options every command shares: the model's source, --hf-args, progress."""
    settings = _with_environment(dict(settings), as_json)
    source = {key: settings.pop(key) for key in ("inputs", "loss", "task")}
    merged, file_notes = _with_hf_args(settings, as_json)  # before _progress: its messages would stop the spinner
    # --json promises one JSON document on stdout: what the user's code prints meanwhile (a --step's logging,
    # peft's print_trainable_parameters() in a model factory) goes to stderr instead.
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        result = function(model, **source, **options, **merged, progress=_progress(as_json))
    if as_json and file_notes:  # --json printed none of them: they go with the answer
        if dataclasses.is_dataclass(result) and "notes" in {field.name for field in dataclasses.fields(result)}:
            return dataclasses.replace(result, notes=(*file_notes, *result.notes))
        if not _quiet():  # results without notes: stderr, which --json keeps apart from the answer
            for note in file_notes:
                click.echo(f"memplan: note: {note}", err=True)
    return result


# Where stderr is no terminal (a log, a pipe), progress is plain lines, and only once a command has
# run this long (MEMPLAN_PROGRESS_AFTER_SECONDS overrides): quick answers stay quiet, long ones say
# what they are doing.
PLAIN_PROGRESS_AFTER_SECONDS = 3.0


def _progress_after_seconds() -> float:
    """MEMPLAN_PROGRESS_AFTER_SECONDS, or the default; a value that is no number of seconds is the user's mistake."""
    text = os.environ.get("MEMPLAN_PROGRESS_AFTER_SECONDS")
    if text is None:
        return PLAIN_PROGRESS_AFTER_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also nan
        raise UsageError(f"MEMPLAN_PROGRESS_AFTER_SECONDS={text!r} is not a number of seconds; give one, such as 3")
    return seconds


def _progress(as_json: bool) -> Callable[[str], None] | None:
    """Progress on stderr naming the current step (--json keeps stdout clean); off with --quiet.

    A spinner on a terminal; elsewhere a line per step once the command has run a few seconds.
    """
    if _quiet():
        return None
    if not sys.stderr.isatty():
        import time

        started = time.monotonic()
        after = _progress_after_seconds()

        def line(message: str) -> None:
            if time.monotonic() - started >= after:
                click.echo(f"memplan: {message}", err=True)

        return line
    from rich.console import Console

    status = Console(stderr=True).status("starting…")
    status.start()
    _ACTIVE_PROGRESS.append(status)
    return lambda message: status.update(f"{message}…")


def _quiet_transformers() -> None:
    with deferred():  # imports transformers (and torch): not interrupted inside their initialisers
        from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # its config warnings are not the user's problem here


def _emit(result: Any, as_json: bool, render: Callable[[Any, Any], None]) -> None:
    """JSON on stdout, or the rendered tables; a result Ctrl-C cut short is shown, then exits 130."""
    if as_json:
        import json

        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        render(result, _stdout_console())
    if getattr(result, "interrupted", False):
        click.echo("memplan: interrupted; shown: what finished before it", err=True)
        sys.exit(130)
