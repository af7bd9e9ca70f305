"""The `memplan` command line: parse, call one library function, render.

One module per command; options.py holds the options they share, running.py what each does around
its library call. Heavy imports (torch, transformers, rich rendering) stay inside the functions, so
that `memplan --help` loads none of them.
"""

from __future__ import annotations

import click

from memplan.cli import compare, estimate, plan, presets, sweep, validate
from memplan.version import __version__

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="memplan")
def main() -> None:
    """memplan: will this training step fit on my GPU, and what do I change if it won't?"""


for command in (presets.presets, estimate.estimate, plan.plan, sweep.sweep, compare.compare, validate.validate):
    main.add_command(command)
