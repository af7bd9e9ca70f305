"""`memplan validate`: run a configuration for real and compare, or a built-in suite of them."""

from __future__ import annotations

import functools
import sys
from typing import Any

import click

from memplan.cli.options import _training_options
from memplan.cli.output_paths import check_output_paths
from memplan.cli.running import _call, _quiet_transformers, _run, _stderr_console, _stdout_console
from memplan.errors import UsageError


@click.command()
@functools.partial(_training_options, model_required=False)
@click.option(
    "--checkpoint",
    default="none",
    show_default=True,
    help="none; all = every repeated block; selective = recompute cheap ops only; or a plan file from `memplan plan`.",
)
@click.option(
    "--suite",
    help="Run a built-in suite instead of one MODEL: main or extended (a GPU with 80 GB), qlora (a GPU with "
    "bitsandbytes), or smoke (CPU).",
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
            raise UsageError("name a MODEL to validate, or a built-in --suite (main, extended, qlora, smoke)")
        for flag, given in (("--results", results is not None), ("--resume", resume)):
            if given:
                raise UsageError(
                    f"{flag} is for a --suite run; one MODEL's result prints (--json for JSON): drop {flag}"
                )
        from memplan.api import validate as run_validate
        from memplan.render.validate import render_validation, validation_to_json

        check_output_paths(snapshot=snapshot)
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

    if results is not None and not results.strip():  # as every other output option: an empty name is a mistake
        raise UsageError("--results is empty; give it a file name, or leave it out for validation-SUITE.json")
    path = Path(results or f"validation-{suite}.json")
    if not path.resolve().parent.is_dir():  # before the first measurement, not after it
        raise UsageError(f"--results {path}: the folder {path.parent} does not exist; create it first")
    force = bool(click.get_current_context().find_root().meta.get("memplan.force"))
    if force and resume:  # one keeps the file's configurations, the other would start it anew
        raise UsageError(
            f"--resume and --force contradict: --resume adds to {path}, --force would replace it; give one of them"
        )
    replace = force
    if replace:
        check_output_paths(results=str(path))  # --force replaces outputs, never the command's inputs
    interrupted = measured = False
    try:
        for config, result in validate_suite(
            suite, path, device=device, resume=resume, warmup=warmup, timeout_s=timeout, replace=replace
        ):
            measured = measured or result is not None
            if result is not None and not as_json:
                _stderr_console().print(" · ".join(suite_row(config.id, result)[:4]))
    except KeyboardInterrupt:
        if not path.exists():
            raise  # nothing finished: nothing to show
        if replace and not measured:  # the file is the old run's, kept until a first result replaces it
            _stderr_console().print(f"[dim]{path} left as it was: no configuration finished[/dim]")
            raise
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
