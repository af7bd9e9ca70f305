"""`memplan estimate`: one configuration's peak; with several --gpu cards, the cheapest that fits."""

from __future__ import annotations

from typing import Any

import click

from memplan.cli.options import SizeType, _cache_option, _training_options
from memplan.cli.output_paths import check_output_paths
from memplan.cli.running import (
    _call,
    _emit,
    _quiet_transformers,
    _run_cached,
    _stderr_console,
    _stdout_console,
)
from memplan.errors import UsageError


def _expandable(alloc_conf: str | None) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF value turns expandable segments on (an unreadable one is
    left for the settings to refuse, with the reason)."""
    from memplan.estimator.cuda.allocator import parse_alloc_conf

    try:
        return alloc_conf is not None and parse_alloc_conf(alloc_conf)[0].expandable_segments
    except ValueError:
        return False


@click.command()
@_training_options
@_cache_option
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
    no_cache: bool,  # read by _run_cached from the command's parameters
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
        check_output_paths(plot=plot, snapshot=snapshot)
        _quiet_transformers()
        result = _call(run_estimate, model, settings, as_json, budget=budget, maximize=maximize)
        _write_pictures(result, plot, snapshot)
        if as_json:
            click.echo(to_json(result))
        else:
            render_estimate(result, _stdout_console())

    _run_cached("estimate", debug, action)


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
