"""`memplan sweep`: peak memory against batch size, per precision and checkpointing."""

from __future__ import annotations

from typing import Any

import click

from memplan.cli.options import SizeType, _cache_option, _training_options
from memplan.cli.output_paths import check_output_paths
from memplan.cli.running import _call, _emit, _quiet_transformers, _run_cached, _stderr_console
from memplan.errors import UsageError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        # int() refuses an empty entry ("1,,2") too; no entries at all are refused as no batch sizes later
        values = tuple(int(part) for part in text.split(",")) if text.strip() else ()
    except ValueError:
        raise UsageError(f"--batch-sizes takes comma-separated integers, e.g. 1,2,4,8; got {text!r}") from None
    return values


def _name_list(text: str | None, option: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):  # an empty entry ("fp32,,bf16") is a typo, not nothing
        raise UsageError(f"{option} takes a comma-separated list of names; got {text!r}")
    return names


@click.command()
@_training_options
@_cache_option
@click.option(
    "--batch-sizes",
    default="1,2,4,8,16,32",
    show_default=True,
    help="Comma-separated micro-batch sizes to trace (replaces --batch-size).",
)
@click.option("--precisions", metavar="LIST", help="Comma-separated precisions [default: --precision].")
@click.option(
    "--checkpoints", metavar="LIST", help="Comma-separated checkpoint modes of none, all and selective [default: none]."
)
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
    no_cache: bool,  # read by _run_cached from the command's parameters
    **settings: Any,
) -> None:
    """Peak memory of MODEL against batch size, per precision and checkpointing.

    The largest batch size, the smallest above 1 and one between are traced; where the step is the same
    requests at each, only their sizes on lines through the batch size, the other points are answered
    from those lines (as exact as a trace; batch size 1 is always traced). With --budget or --gpu, each
    setting also gets the largest batch size that fits (the same search as `estimate --budget`).
    """

    def action() -> None:
        from click.core import ParameterSource

        from memplan.api import sweep as run_sweep

        if click.get_current_context().get_parameter_source("batch_size") != ParameterSource.DEFAULT:
            raise UsageError("sweep traces --batch-sizes (e.g. 1,2,4,8); --batch-size is for one configuration")
        check_output_paths(plot=plot)
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
            from memplan.render.explore import sweep_settings
            from memplan.render.plot import plot_sweep

            device = result.settings.device == "cuda"  # what the budget is compared with there
            series = {
                s.label: [(p.batch_size, p.smallest_device_bytes if device else p.peak_bytes) for p in s.points]
                for s in result.series
            }
            plot_sweep(
                series,
                plot,
                # the precision only where one is swept; a sweep Ctrl-C stopped says that its lines are not all
                title=f"{result.model}: {sweep_settings(result)}"
                + (" (interrupted: the settings that finished before Ctrl-C)" if result.interrupted else ""),
                budget_bytes=result.budget_bytes,
                max_batch_sizes={s.label: s.max_batch_size for s in result.series},
                measure="predicted memory the step completes in" if device else "predicted peak",
            )
            _stderr_console().print(f"[dim]plot: {plot}[/dim]")
        from memplan.render.explore import render_sweep

        _emit(result, as_json, render_sweep)

    _run_cached("sweep", debug, action)


# The shared training options' --batch-size means nothing here (--batch-sizes replaces it; the action refuses it):
# not shown in sweep's help, where it had been listed with a default (CLI bug hunt).
for _parameter in sweep.params:
    if _parameter.name == "batch_size":
        _parameter.hidden = True  # type: ignore[attr-defined]
