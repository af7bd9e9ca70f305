"""`memplan plan`: the checkpointing plan that fits a budget; with --maximize-batch, the batch size too."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from memplan.cli.options import SizeType, _training_options
from memplan.cli.output_paths import check_output_paths
from memplan.cli.running import _call, _emit, _quiet_transformers, _run, _stdout_console
from memplan.errors import UsageError


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


@click.command()
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

        check_output_paths(output=output)
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
