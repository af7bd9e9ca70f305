"""The `memplan` command line: parse, call one library function, render.

One module per command; options.py holds the options they share, running.py what each does around
its library call. Heavy imports (torch, transformers, rich rendering) stay inside the functions, so
that `memplan --help` loads none of them.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from memplan.cli import compare, estimate, plan, presets, sweep, validate
from memplan.version import __version__

__all__ = ["main"]


class _OneLineErrors(click.Group):
    """click's own usage errors (an unknown option, a value not among the choices, a file that cannot be read,
    an environment variable it cannot parse) as memplan's other mistakes are: one line on stderr, exit 2.
    click prints them as four (usage, a hint, a blank line, the error)."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:  # a caller that handles click's exceptions itself (as click documents it)
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            returned = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as error:
            # `memplan` alone: the help, as click shows it (click 8.2+; older clicks exit 0 after printing it)
            if isinstance(error, getattr(click.exceptions, "NoArgsIsHelpError", ())):
                error.show()
                sys.exit(error.exit_code)
            hint = f"; see '{error.ctx.command_path} -h'" if getattr(error, "ctx", None) is not None else ""
            click.echo(f"memplan: error: {error.format_message().rstrip('.')}{hint}", err=True)
            sys.exit(error.exit_code)
        except click.Abort:  # Ctrl-C while click itself ran (a prompt, parsing): as memplan's own interrupt
            click.echo("memplan: interrupted", err=True)
            sys.exit(130)
        sys.exit(returned if isinstance(returned, int) else 0)  # --help and --version return their code


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="memplan")
def main() -> None:
    """memplan: will this training step fit on my GPU, and what do I change if it won't?"""


for command in (presets.presets, estimate.estimate, plan.plan, sweep.sweep, compare.compare, validate.validate):
    main.add_command(command)
