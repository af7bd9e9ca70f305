"""The `memplan` command line: parse, call one library function, render.

One module per command; options.py holds the options they share, running.py what each does around
its library call. Heavy imports (torch, transformers, rich rendering) stay inside the functions, so
that `memplan --help` loads none of them.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

import click

from memplan.cli import compare, estimate, plan, presets, sweep, validate
from memplan.cli.running import FULL_DISK_ERRORS, cannot_write
from memplan.version import __version__

__all__ = ["main", "run"]


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
        except OSError as error:
            # --help, --version and `presets` print outside a command's own error handling (running.py's):
            # `> /dev/full` is said as a command says it
            if error.errno not in FULL_DISK_ERRORS:
                raise
            click.echo(cannot_write(error), err=True)
            sys.exit(1)
        sys.exit(returned if isinstance(returned, int) else 0)  # --help and --version return their code


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="memplan")
@click.pass_context
def main(context: click.Context) -> None:
    """memplan: will this training step fit on my GPU, and what do I change if it won't?"""
    from memplan.api_terms import command_line_terms

    # memplan.api words its errors in keywords for Python callers; for the command it runs, in flags
    context.with_resource(command_line_terms())


for command in (presets.presets, estimate.estimate, plan.plan, sweep.sweep, compare.compare, validate.validate):
    main.add_command(command)


def run() -> None:
    """The `memplan` process (its console script and `python -m memplan`): main(), then out at once.

    An estimate leaves torch, transformers and their million objects in the interpreter; tearing them
    down at exit (module by module, object by object) took about half a second of a gpt2 estimate on the
    2-core CI machine (benchmarks/exit_teardown.py), time in which nothing is left to do. So once main()
    has finished: the atexit functions run as at a normal exit (logging's flush, temporary directories'
    finalizers, torch's own), the standard streams are flushed, and os._exit ends the process without the
    teardown. Where a thread other than daemons is still running (a normal exit would wait for it), or main()
    raised anything but SystemExit (a --debug traceback), the exit is Python's own. Tests call main() in
    their process."""
    code = None
    # A stream closed when the process started (`memplan ... >&-`) is None in Python: what memplan would print
    # there goes nowhere, as the user asked, instead of failing on None.
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (the process's stdout, open to its end)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    try:
        main()
    except SystemExit as exit_request:
        code = exit_request.code
    others = (thread for thread in threading.enumerate() if thread is not threading.main_thread())
    if any(thread.is_alive() and not thread.daemon for thread in others):
        sys.exit(code)
    os._exit(_exit_status(code))


def _exit_status(code: object) -> int:
    """What Python's own exit would make of SystemExit's code (None is 0, an int itself, anything else is
    printed to stderr and is 1), after the atexit functions and with the standard streams flushed: 120
    where a flush fails, as CPython exits when it cannot flush them (Py_FinalizeEx), unless the command
    failed already."""
    status = 0
    if isinstance(code, int):
        status = code
    elif code is not None:
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`memplan ... | head`), a closed stream
            status = status or 120  # a failure already said (a full disk) keeps its own status
    return status
