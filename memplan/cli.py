"""The `memplan` command line: parse, call one library function, render."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from memplan import interrupts
from memplan.compat import require_supported_torch
from memplan.errors import MemplanError, SizeParseError, UsageError
from memplan.interrupts import reliable_interrupts
from memplan.settings import (
    ATTENTION_IMPLEMENTATIONS,
    DEVICES,
    LOOPS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PARALLEL_MODES,
    PRECISIONS,
    QUANT_TYPES,
    parse_size,
)
from memplan.version import __version__


class SizeType(click.ParamType):
    """A memory size: 80GB, 24GiB, 512MiB or plain bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except SizeParseError as error:
            self.fail(str(error), param, ctx)


_ACTIVE_PROGRESS: list[Any] = []  # rich Status spinners on stderr, stopped before anything else prints


def _stop_progress() -> None:
    while _ACTIVE_PROGRESS:
        _ACTIVE_PROGRESS.pop().stop()


def _quiet() -> bool:
    context = click.get_current_context(silent=True)
    return bool(context is not None and context.find_root().meta.get("memplan.quiet"))


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


def _set_force(context: click.Context, parameter: click.Parameter, value: bool) -> None:
    if value:
        context.find_root().meta["memplan.force"] = True


def _set_quiet(context: click.Context, parameter: click.Parameter, value: bool) -> None:
    if value:
        context.find_root().meta["memplan.quiet"] = True


def _show_debug_messages() -> None:
    """memplan's own debug log (why planning ran in one process, ...) on stderr, once per process."""
    logger = logging.getLogger("memplan")
    logger.setLevel(logging.DEBUG)
    if not any(getattr(handler, "memplan_debug", False) for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.memplan_debug = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def _run(debug: bool, action: Callable[[], None]) -> None:
    """Turn MemplanError into one line on stderr and its exit code; tracebacks only with --debug.

    The exit happens after the except clauses: exiting inside one would keep the exception, and
    through its traceback every frame of the interrupted work, alive until the interpreter shuts
    down, whose teardown then fails in those objects' finalizers (torch's StorageWeakRef.__del__
    printed "Exception ignored ..." after "memplan: interrupted").
    """
    if debug:
        _show_debug_messages()
    message, code = None, 0
    try:
        require_supported_torch()
        try:
            with reliable_interrupts():
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
        else:  # a bug in memplan or torch: say so, keep the details for --debug
            message, code = f"memplan: internal error: {type(error).__name__}: {error} (rerun with --debug)", 1
    if message is not None:
        _collect_before_teardown()
        click.echo(message, err=True)
        sys.exit(code)


@functools.cache
def _collect_before_teardown() -> None:
    """Free the failed work's objects at exit, before the interpreter tears its modules down (atexit
    handlers run first), so that their finalizers still find torch intact. Registered once (cached),
    not run at each error: a full collection over a large heap takes a good part of a second, which
    every refused command would pay (the test suite's hundred refusals in one process did)."""
    atexit.register(gc.collect)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="memplan")
def main() -> None:
    """memplan: will this training step fit on my GPU, and what do I change if it won't?"""


@main.command()
def presets() -> None:
    """List the model presets shipped with memplan."""
    from rich.console import Console

    from memplan.render.presets import render_presets

    render_presets(Console(highlight=False))


def _training_options(command: Callable[..., None], model_required: bool = True) -> Callable[..., None]:
    """The options that describe one training iteration, shared by estimate, plan and validate."""
    options = [
        click.argument("model", required=model_required),
        click.option("--batch-size", "-b", type=int, default=1, show_default=True, help="Micro-batch size."),
        click.option("--seq-len", type=int, help="Sequence length for text models [default: min(512, maximum)]."),
        click.option("--target-len", type=int, help="Decoder length for seq2seq models [default: --seq-len]."),
        click.option("--image-size", type=int, help="Image side for vision models [default: the config's, or 224]."),
        click.option("--grad-accum", type=int, default=1, show_default=True, help="Gradient accumulation steps."),
        click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True),
        click.option(
            "--optimizer-impl",
            type=click.Choice(OPTIMIZER_IMPLS),
            default="default",
            show_default=True,
            help="default = what torch picks on the target device (foreach on CUDA, for-loop on CPU).",
        ),
        click.option(
            "--device", type=click.Choice(DEVICES), default="cuda", show_default=True, help="The target device."
        ),
        click.option(
            "--gpu",
            metavar="NAME",
            help="The card: its compute capability picks CUDA kernels, and its usable memory is the budget "
            "unless --budget is given (H100-80GB, H200, A100-40GB, A100-80GB, L4, A10G, RTX-4090, T4, ...). "
            "`estimate` takes a comma-separated list: which of the cards it fits, and the cheapest that it does.",
        ),
        click.option(
            "--attn-impl",
            type=click.Choice(ATTENTION_IMPLEMENTATIONS),
            default="sdpa",
            show_default=True,
            help="transformers' attn_implementation (sdpa where the architecture supports it).",
        ),
        click.option(
            "--lora",
            "lora_rank",
            type=int,
            metavar="RANK",
            help="Train LoRA adapters of this rank (built with peft: pip install 'memplan[peft]'); the model's "
            "own weights are frozen.",
        ),
        click.option("--lora-alpha", type=float, help="LoRA's lora_alpha [default: peft's]."),
        click.option(
            "--lora-targets",
            metavar="NAMES",
            help="Comma-separated module names the adapters go on [default: peft's for the architecture].",
        ),
        click.option("--lora-dropout", type=float, default=0.0, show_default=True, help="LoRA's lora_dropout."),
        click.option(
            "--quantize",
            type=click.Choice(QUANT_TYPES),
            help="QLoRA: the base model's linear layers in bitsandbytes' 4-bit layout (nf4, fp4: double-quantized, "
            "computed in the precision's 16-bit dtype) or LLM.int8()'s (int8: outlier threshold 6.0); needs --lora "
            "(pip install 'memplan[qlora]').",
        ),
        click.option(
            "--kbit-upcast/--no-kbit-upcast",
            default=True,
            show_default=True,
            help="With --quantize: peft's prepare_model_for_kbit_training casts the layers left in 16 bits "
            "(embeddings, norms, LM head) to float32.",
        ),
        click.option(
            "--cuda-context",
            type=SizeType(),
            help="The CUDA context nvidia-smi shows beyond what torch reserves (e.g. 600MiB), counted in the "
            "device total and taken off --gpu's memory [default: 767 MiB, measured on an H100 with CUDA 13].",
        ),
        click.option(
            "--cudnn-benchmark",
            is_flag=True,
            help="The run sets torch.backends.cudnn.benchmark = True (convolutions: see docs/concepts.md).",
        ),
        click.option(
            "--deterministic",
            is_flag=True,
            help="The run calls torch.use_deterministic_algorithms(True) (flash attention's backward keeps more).",
        ),
        click.option(
            "--cudnn-tf32/--no-cudnn-tf32",
            "cudnn_allow_tf32",
            default=True,
            show_default=True,
            help="torch.backends.cudnn.allow_tf32: off, fp32 convolutions leave tensor cores (no workspace band).",
        ),
        click.option(
            "--cudnn-workspace-cap",
            "cudnn_workspace_cap_mib",
            type=click.IntRange(min=0),
            metavar="MIB",
            envvar="CUDNN_CONV_WSCAP_DBG",
            show_envvar=True,
            help="Cap each cuDNN convolution workspace at MIB MiB, as CUDNN_CONV_WSCAP_DBG does.",
        ),
        click.option(
            "--cublas-workspace-config",
            metavar=":SIZE:COUNT",
            envvar="CUBLAS_WORKSPACE_CONFIG",
            show_envvar=True,
            help="The run's CUBLAS_WORKSPACE_CONFIG (e.g. :4096:8 or :16:8): the size of each cuBLAS workspace.",
        ),
        click.option(
            "--cuda-alloc-conf",
            metavar="KEY:VALUE,...",
            envvar="PYTORCH_CUDA_ALLOC_CONF",
            show_envvar=True,
            help="The run's PYTORCH_CUDA_ALLOC_CONF: expandable_segments, max_split_size_mb, max_non_split_rounding_mb "
            "and roundup_power2_divisions are simulated; other keys are noted.",
        ),
        click.option(
            "--loop",
            type=click.Choice(LOOPS),
            default="canonical",
            show_default=True,
            help="The training loop: where zero_grad runs and what stays alive (docs/concepts.md); "
            "--hf-args picks hf-trainer.",
        ),
        click.option(
            "--parallel",
            type=click.Choice(PARALLEL_MODES),
            default="none",
            show_default=True,
            help="Data parallelism: ddp traces one rank of torch's DistributedDataParallel (its gradient buckets "
            "included); batch settings are per rank.",
        ),
        click.option(
            "--world-size",
            type=int,
            default=1,
            show_default=True,
            help="Data-parallel ranks with --parallel (the total batch is micro-batch × accumulation × ranks).",
        ),
        click.option(
            "--ddp-bucket-view",
            is_flag=True,
            help="With --parallel ddp: DistributedDataParallel(gradient_as_bucket_view=True), the gradients views "
            "into DDP's buckets instead of a second copy.",
        ),
        click.option(
            "--step",
            metavar="MODULE:FN",
            help="Your own training iteration instead of the loop: fn(model, batch, optimizer) runs one "
            "(forward passes, losses, backward, optimizer step, zero_grad as you write them; docs/usage.md).",
        ),
        click.option(
            "--task",
            help="Head for transformers models: causal-lm, masked-lm, sequence-classification, seq2seq, "
            "image-classification.",
        ),
        click.option(
            "--hf-args",
            type=click.Path(dir_okay=False),
            help="A Hugging Face TrainingArguments JSON/YAML file: batch size, accumulation, bf16/fp16, "
            "gradient_checkpointing and optim; flags given explicitly override it.",
        ),
        click.option("--inputs", help="package.module:fn where fn(batch_size) returns the batch (custom models)."),
        click.option("--loss", help="package.module:fn where fn(output, batch) returns the scalar loss."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout."),
        click.option(
            "--quiet",
            "-q",
            is_flag=True,
            expose_value=False,
            callback=_set_quiet,
            help="No progress, notes or file messages on stderr (errors still print).",
        ),
        click.option(
            "--force",
            is_flag=True,
            expose_value=False,
            callback=_set_force,
            help="Replace output files (--plot, --snapshot, --output) that exist; inputs are never replaced.",
        ),
        click.option("--debug", is_flag=True, help="Show tracebacks."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _check_output_paths(**paths: str | None) -> None:
    """Before the work, not after it: refuse an output whose folder does not exist, that is one of
    the command's own input files, or that exists when --force was not given (memplan.outputs)."""
    from memplan.outputs import check_output

    context = click.get_current_context()
    force = bool(context.find_root().meta.get("memplan.force"))
    inputs = [context.params.get(name) for name in ("hf_args", "checkpoint")]
    for option, path in paths.items():
        if path is not None:
            check_output(option, path, inputs=[given for given in inputs if isinstance(given, str)], force=force)
    if paths.get("plot") is not None:
        from memplan.render.plot import check_plot_path

        check_plot_path(paths["plot"])


def _with_hf_args(settings: dict[str, Any], as_json: bool) -> dict[str, Any]:
    """Settings from --hf-args under the flags the user typed (a flag left at its default does not count)."""
    from click.core import ParameterSource

    path = settings.pop("hf_args", None)
    if path is None:
        return settings
    from memplan.hf_args import read_training_args

    context = click.get_current_context()

    def typed(name: str) -> bool:
        return context.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)

    loaded = read_training_args(path, read_optim=not typed("optimizer"))
    context_name = context.info_name
    if context_name == "plan":
        loaded.settings.pop("checkpoint", None)  # plan chooses the checkpointing itself
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
    return merged


# Options a CUDA library's own environment variable also sets (click's envvar=).
_ENVIRONMENT_OPTIONS = {
    "cudnn_workspace_cap_mib": "CUDNN_CONV_WSCAP_DBG",
    "cublas_workspace_config": "CUBLAS_WORKSPACE_CONFIG",
    "cuda_alloc_conf": "PYTORCH_CUDA_ALLOC_CONF",
}


def _with_environment(settings: dict[str, Any], as_json: bool) -> dict[str, Any]:
    """Say which settings came from the environment; a CUDA variable means nothing for a cpu target."""
    from click.core import ParameterSource

    context = click.get_current_context()
    for name, variable in _ENVIRONMENT_OPTIONS.items():
        if context.get_parameter_source(name) != ParameterSource.ENVIRONMENT:
            continue
        if settings.get("device") == "cpu":
            settings[name] = None
        elif not as_json and not _quiet():
            _stderr_console().print(f"[dim]from the environment: {variable}={settings[name]}[/dim]")
    return settings


def _expandable(alloc_conf: str | None) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF value turns expandable segments on (an unreadable one is
    left for the settings to refuse, with the reason)."""
    from memplan.estimator.cuda.allocator import parse_alloc_conf

    try:
        return alloc_conf is not None and parse_alloc_conf(alloc_conf)[0].expandable_segments
    except ValueError:
        return False


def _call(function: Callable[..., Any], model: str, settings: dict[str, Any], as_json: bool, **options: Any) -> Any:
    """One library call with the options every command shares: the model's source, --hf-args, progress."""
    settings = _with_environment(dict(settings), as_json)
    source = {key: settings.pop(key) for key in ("inputs", "loss", "task")}
    merged = _with_hf_args(settings, as_json)  # before _progress: its messages would stop the spinner
    return function(model, **source, **options, **merged, progress=_progress(as_json))


# Where stderr is no terminal (a log, a pipe), progress is plain lines, and only once a command has
# run this long (MEMPLAN_PROGRESS_AFTER_SECONDS overrides): quick answers stay quiet, long ones say
# what they are doing.
PLAIN_PROGRESS_AFTER_SECONDS = 3.0


def _progress(as_json: bool) -> Callable[[str], None] | None:
    """Progress on stderr naming the current step (--json keeps stdout clean); off with --quiet.

    A spinner on a terminal; elsewhere a line per step once the command has run a few seconds.
    """
    if _quiet():
        return None
    if not sys.stderr.isatty():
        import time

        started = time.monotonic()
        after = float(os.environ.get("MEMPLAN_PROGRESS_AFTER_SECONDS", PLAIN_PROGRESS_AFTER_SECONDS))

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
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # its config warnings are not the user's problem here


@main.command()
@_training_options
@click.option(
    "--checkpoint",
    default="none",
    show_default=True,
    help="none; all = every repeated block, like HF gradient checkpointing; selective = every repeated block, "
    "keeping matmul/conv/attention outputs and recomputing the rest; or a plan file from `memplan plan`.",
)
@click.option("--budget", type=SizeType(), help="Memory budget (80GB, 24GiB, 512MiB, bytes): fits? largest batch?")
@click.option(
    "--maximize",
    type=click.Choice(["seq-len"]),
    help="With --budget or --gpu: also the longest --seq-len that fits at the batch size (a trace per length tried).",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Write a PNG of the iteration's memory over time, stacked by category.",
)
@click.option(
    "--snapshot",
    type=click.Path(dir_okay=False),
    help="cuda: write the predicted iteration as a torch.cuda.memory._snapshot() pickle for memory_viz.",
)
def estimate(
    model: str,
    budget: int | None,
    maximize: str | None,
    plot: str | None,
    snapshot: str | None,
    as_json: bool,
    debug: bool,
    **settings: Any,
) -> None:
    """Predict the peak memory of one training iteration of MODEL.

    MODEL is a preset (`memplan presets`), a transformers model type, a config.json or model
    directory, a hub id in the local cache, or package.module:callable returning an nn.Module.
    """

    def action() -> None:
        from memplan.api import estimate as run_estimate
        from memplan.render.estimate import render_estimate, to_json

        if "," in (settings.get("gpu") or ""):
            _which_gpu(model, settings, as_json, budget=budget, maximize=maximize, plot=plot, snapshot=snapshot)
            return
        if snapshot is not None and settings["device"] != "cuda":
            raise UsageError("--snapshot writes the CUDA caching allocator's view; use it with --device cuda")
        if snapshot is not None and _expandable(settings.get("cuda_alloc_conf")):
            raise UsageError(
                "--snapshot draws the default allocator's segments, not expandable segments; "
                "drop one of --snapshot and expandable_segments:True"
            )
        _check_output_paths(plot=plot, snapshot=snapshot)
        _quiet_transformers()
        result = _call(run_estimate, model, settings, as_json, budget=budget, maximize=maximize)
        _write_pictures(result, plot, snapshot)
        if as_json:
            click.echo(to_json(result))
        else:
            render_estimate(result, _stdout_console())

    _run(debug, action)


def _which_gpu(model: str, settings: dict[str, Any], as_json: bool, **refused: Any) -> None:
    """`estimate --gpu A,B,C`: the configuration on each card, and the cheapest that fits."""
    from memplan.api import which_gpu
    from memplan.render.explore import render_gpu_choice

    for option, value in refused.items():
        if value is not None:
            raise UsageError(
                f"--{option} with several --gpu cards: each card's own memory is its budget and there is one "
                f"estimate per card; name one card to use --{option}"
            )
    gpus = settings.pop("gpu")
    _quiet_transformers()
    result = _call(which_gpu, model, settings, as_json, gpus=gpus)
    _emit(result, as_json, render_gpu_choice)


def _plan_batch(call: Callable[..., Any], output: str | None, as_json: bool) -> None:
    from click.core import ParameterSource

    from memplan.api import plan_batch
    from memplan.planner.plan_file import write_plan
    from memplan.render.plan import render_batch_options

    if click.get_current_context().get_parameter_source("batch_size") != ParameterSource.DEFAULT:
        raise UsageError("--maximize-batch chooses the batch size; leave out --batch-size")
    result = call(plan_batch)
    if output is not None:
        write_plan(result.best.plan, output)
    _emit(result, as_json, lambda result, console: render_batch_options(result, console, output))


def _write_pictures(result: Any, plot: str | None, snapshot: str | None) -> None:
    from memplan.render.estimate import describe_settings

    title = f"{result.model}: {describe_settings(result.settings)}"
    if plot is not None:
        from memplan.render.plot import plot_timeline

        plot_timeline(
            result.timeline,
            plot,
            title=title,
            budget_bytes=result.budget_bytes,
            reserved_peak_bytes=result.reserved_peak_bytes,
        )
        _stderr_console().print(f"[dim]plot: {plot}[/dim]")
    if snapshot is not None:
        from memplan.render.snapshot import predicted_snapshot, write_snapshot

        metadata = {"model": result.model, "settings": result.settings.to_dict(), "peak_bytes": result.peak_bytes}
        write_snapshot(predicted_snapshot(result.timeline, metadata), snapshot)
        view = f"python -m torch.cuda._memory_viz trace_plot {snapshot} -o page.html"
        _stderr_console().print(f"[dim]snapshot: {snapshot} (view it: {view})[/dim]")


@main.command()
@_training_options
@click.option(
    "--budget",
    type=SizeType(),
    help="The byte budget to fit (80GB, 24GiB, 512MiB, bytes) [default: --gpu's usable memory].",
)
@click.option(
    "--candidates",
    metavar="REGEX",
    help="Modules that may be checkpointed (full-match on qualified names) [default: every repeated block].",
)
@click.option(
    "--solver",
    type=click.Choice(["auto", "dp", "greedy"]),
    default="auto",
    show_default=True,
    help="dp = exact on the chain cost model; greedy = fast heuristic; auto = dp up to 128 candidates.",
)
@click.option(
    "--selective",
    is_flag=True,
    help="Also offer selective checkpointing of every candidate (keep matmul/conv/attention outputs, "
    "recompute the rest), traced like the baselines.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Processes that trace the plan's layouts at once [default: one per available core].",
)
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Write the plan to this JSON file.")
@click.option(
    "--maximize-batch",
    is_flag=True,
    help="cuda: choose the batch size too, by the best roofline throughput within the budget "
    "(replaces --batch-size; --output gets the best option's plan).",
)
def plan(
    model: str,
    budget: int | None,
    candidates: str | None,
    solver: str,
    selective: bool,
    jobs: int | None,
    output: str | None,
    maximize_batch: bool,
    as_json: bool,
    debug: bool,
    **settings: Any,
) -> None:
    """Choose which blocks of MODEL to checkpoint so one training iteration fits --budget.

    The plan is the least recomputation whose re-traced, simulated peak fits; it is shown beside
    the usual baselines (none, all blocks, sqrt(n) segments, every 2nd block), all simulated the same way.
    """

    def action() -> None:
        from memplan.api import plan as make_plan
        from memplan.planner.plan_file import write_plan
        from memplan.render.plan import plan_to_json, render_plan

        _check_output_paths(output=output)
        _quiet_transformers()
        call = functools.partial(
            _call,
            model=model,
            settings=settings,
            as_json=as_json,
            budget=budget,
            candidates=candidates,
            solver=solver,
            jobs=jobs,
        )
        if maximize_batch:
            if selective:
                raise UsageError("--selective plans one batch size; drop it or --maximize-batch")
            _plan_batch(call, output, as_json)
            return
        result = call(make_plan, selective=selective)
        if output is not None:
            write_plan(result, output)
        if as_json:
            click.echo(plan_to_json(result))
        else:
            render_plan(result, _stdout_console(), output)

    _run(debug, action)


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


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--batch-sizes takes comma-separated integers, e.g. 1,2,4,8; got {text!r}") from None
    return values


def _name_list(text: str | None, option: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise UsageError(f"{option} takes a comma-separated list of names; got {text!r}")
    return names


@main.command()
@_training_options
@click.option(
    "--batch-sizes",
    default="1,2,4,8,16,32",
    show_default=True,
    help="Comma-separated micro-batch sizes to trace (replaces --batch-size).",
)
@click.option("--precisions", metavar="LIST", help="Comma-separated precisions [default: --precision].")
@click.option("--checkpoints", metavar="LIST", help="Comma-separated checkpoint modes, none,all [default: none].")
@click.option("--budget", type=SizeType(), help="Memory budget: mark what fits, find each largest batch.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG of peak against batch size.")
def sweep(
    model: str,
    batch_sizes: str,
    precisions: str | None,
    checkpoints: str | None,
    budget: int | None,
    plot: str | None,
    as_json: bool,
    debug: bool,
    **settings: Any,
) -> None:
    """Peak memory of MODEL against batch size, per precision and checkpointing.

    Every point is traced and simulated. With --budget or --gpu, each setting also gets the largest
    batch size that fits (the same search as `estimate --budget`).
    """

    def action() -> None:
        from click.core import ParameterSource

        from memplan.api import sweep as run_sweep

        if click.get_current_context().get_parameter_source("batch_size") != ParameterSource.DEFAULT:
            raise UsageError("sweep traces --batch-sizes (e.g. 1,2,4,8); --batch-size is for one configuration")
        _check_output_paths(plot=plot)
        _quiet_transformers()
        result = _call(
            run_sweep,
            model,
            settings,
            as_json,
            batch_sizes=_int_list(batch_sizes),
            precisions=_name_list(precisions, "--precisions"),
            checkpoints=_name_list(checkpoints, "--checkpoints"),
            budget=budget,
        )
        if plot is not None:
            from memplan.render.estimate import describe_settings
            from memplan.render.plot import plot_sweep

            device = result.settings.device == "cuda"  # what the budget is compared with there
            series = {
                s.label: [(p.batch_size, p.smallest_device_bytes if device else p.peak_bytes) for p in s.points]
                for s in result.series
            }
            base = result.settings.replace(checkpoint="none")
            plot_sweep(
                series,
                plot,
                title=f"{result.model}: {describe_settings(base, with_batch=False)}",
                budget_bytes=result.budget_bytes,
                max_batch_sizes={s.label: s.max_batch_size for s in result.series},
                measure="predicted memory the step completes in" if device else "predicted peak",
            )
            _stderr_console().print(f"[dim]plot: {plot}[/dim]")
        from memplan.render.explore import render_sweep

        _emit(result, as_json, render_sweep)

    _run(debug, action)


@main.command()
@_training_options
@click.option("--gpus", type=int, default=1, show_default=True, help="Data-parallel GPUs (multiplies the batch).")
@click.option("--budget", type=SizeType(), help="Memory budget: which techniques fit.")
def compare(
    model: str,
    gpus: int,
    budget: int | None,
    as_json: bool,
    debug: bool,
    **settings: Any,
) -> None:
    """One table of the techniques people try: precision, accumulation, optimizers, checkpointing.

    Each row changes the given settings one way and is traced and simulated; the cost column
    says what it trades for memory (recomputed FLOPs, micro-steps, numerics).
    """

    def action() -> None:
        from memplan.api import compare as run_compare

        _quiet_transformers()
        result = _call(run_compare, model, settings, as_json, gpus=gpus, budget=budget)
        from memplan.render.explore import render_compare

        _emit(result, as_json, render_compare)

    _run(debug, action)


@main.command()
@functools.partial(_training_options, model_required=False)
@click.option(
    "--checkpoint",
    default="none",
    show_default=True,
    help="none; all = every repeated block; or a plan file from `memplan plan`.",
)
@click.option(
    "--suite", help="Run a built-in suite instead of one MODEL: main or extended (a GPU with 80 GB), or smoke (CPU)."
)
@click.option(
    "--results",
    type=click.Path(dir_okay=False),
    help="With --suite: the results file, written after every configuration [default: validation-SUITE.json].",
)
@click.option("--resume", is_flag=True, help="With --suite: skip the configurations already in --results.")
@click.option(
    "--snapshot", type=click.Path(dir_okay=False), help="cuda: save the measured iteration's memory snapshot."
)
@click.option(
    "--warmup",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Iterations run before the measured one (at least 1: the first creates the optimizer state).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=1800,
    show_default=True,
    help="Seconds allowed per configuration.",
)
def validate(
    model: str | None,
    suite: str | None,
    results: str | None,
    resume: bool,
    snapshot: str | None,
    warmup: int,
    timeout: float,
    as_json: bool,
    debug: bool,
    **settings: Any,
) -> None:
    """Run MODEL for real and compare the measured peak with the prediction.

    Takes the same arguments as `estimate`. Each configuration runs in its own subprocess, so an
    out-of-memory error or a CUDA error is a result, not a crash. --suite NAME runs a built-in set
    of configurations instead (same --device), appending each result to --results as it goes.
    """

    def action() -> None:

        _quiet_transformers()
        if suite is not None:
            if model is not None:
                raise UsageError(f"--suite {suite} runs its own configurations: drop MODEL ({model}), or drop --suite")
            _validate_suite(suite, results, resume, settings["device"], warmup, timeout, as_json)
            return
        if model is None:
            raise UsageError("name a MODEL to validate, or a built-in --suite (main, extended, smoke)")
        for flag, given in (("--results", results is not None), ("--resume", resume)):
            if given:
                raise UsageError(
                    f"{flag} is for a --suite run; one MODEL's result prints (--json for JSON): drop {flag}"
                )
        from memplan.api import validate as run_validate
        from memplan.render.validate import render_validation, validation_to_json

        _check_output_paths(snapshot=snapshot)
        result = _call(run_validate, model, settings, as_json, warmup=warmup, snapshot=snapshot, timeout_s=timeout)
        if as_json:
            click.echo(validation_to_json(result))
        else:
            render_validation(result, _stdout_console())
        if result.error is not None and not result.out_of_memory:
            sys.exit(1)  # the run failed before measuring: a failure, not a result (an OOM is one)

    _run(debug, action)


def _validate_suite(
    suite: str, results: str | None, resume: bool, device: str, warmup: int, timeout: float, as_json: bool
) -> None:
    import json
    from pathlib import Path

    from memplan.api import validate_suite
    from memplan.render.validate import render_suite, suite_row
    from memplan.validate.suite import load_results, result_rows, summary

    path = Path(results or f"validation-{suite}.json")
    if not path.resolve().parent.is_dir():  # before the first measurement, not after it
        raise UsageError(f"--results {path}: the folder {path.parent} does not exist; create it first")
    interrupted = False
    try:
        for config, result in validate_suite(
            suite, path, device=device, resume=resume, warmup=warmup, timeout_s=timeout
        ):
            if result is not None and not as_json:
                _stderr_console().print(" · ".join(suite_row(config.id, result)[:4]))
    except KeyboardInterrupt:
        if not path.exists():
            raise  # nothing finished: nothing to show
        interrupted = True  # the file holds every finished configuration: show them, then stop as interrupted
    document = load_results(path)
    rows = result_rows(document)
    totals = summary([result for _, result in rows])
    if as_json:
        click.echo(json.dumps({**document, "summary": totals, "interrupted": interrupted}, indent=2))
    else:
        render_suite(rows, totals, _stdout_console())
        resume_hint = f"; continue with --resume --results {path}" if interrupted else ""
        _stderr_console().print(f"[dim]results: {path}{resume_hint}[/dim]")
    if interrupted:
        raise KeyboardInterrupt


if __name__ == "__main__":
    main()
