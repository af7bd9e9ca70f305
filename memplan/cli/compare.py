"""`memplan compare`: the techniques people try, one row each."""

from __future__ import annotations

from typing import Any

import click

from memplan.cli.options import SizeType, _cache_option, _training_options
from memplan.cli.running import _call, _emit, _quiet_transformers, _run_cached


@click.command()
@_training_options
@_cache_option
@click.option("--gpus", type=int, default=1, show_default=True, help="Data-parallel GPUs (multiplies the batch).")
@click.option("--budget", type=SizeType(), help="Memory budget: which techniques fit.")
def compare(
    model: str,
    gpus: int,
    budget: int | None,
    as_json: bool,
    debug: bool,
    no_cache: bool,  # read by _run_cached from the command's parameters
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

    _run_cached("compare", debug, action)
