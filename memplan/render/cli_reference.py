"""docs/cli.md, generated from the click commands themselves (tests/test_docs.py keeps it in sync).

Regenerate with `python -m memplan.render.cli_reference > docs/cli.md`.
"""

from __future__ import annotations

import click

# Fixed widths, so the text does not depend on the terminal that generates it.
HELP_WIDTH = 100

HEADER = """# CLI reference

Generated from the commands' own help by `python -m memplan.render.cli_reference > docs/cli.md`;
`tests/test_docs.py` fails when this file and the commands disagree. `memplan COMMAND --help`
prints the same text.

Exit codes: 0 done (an out-of-memory *measurement* is a result, so it is 0 too), 1 a failure of
the work (a model that cannot be traced, a run that crashed), 2 a usage mistake (an unknown model,
a bad size, an option that does not apply). Errors are one line on stderr; `--debug` adds the
traceback. JSON goes to stdout, messages and progress to stderr; `--quiet` silences the messages.
Progress is a spinner on a terminal; piped or logged, a `memplan: ...` line per step once a command
has run 3 seconds (`MEMPLAN_PROGRESS_AFTER_SECONDS` changes that).

## Shell completion

click generates it. For bash, add to `~/.bashrc`:

    eval "$(_MEMPLAN_COMPLETE=bash_source memplan)"

For zsh use `zsh_source` in `~/.zshrc`; for fish,
`_MEMPLAN_COMPLETE=fish_source memplan > ~/.config/fish/completions/memplan.fish`.
"""


def _context(command: click.Command, name: str, parent: click.Context | None) -> click.Context:
    """The context click itself would make (context_settings applied, e.g. -h), at a fixed width."""
    return command.make_context(
        name, [], parent=parent, resilient_parsing=True, terminal_width=HELP_WIDTH, max_content_width=HELP_WIDTH
    )


def cli_reference(group: click.Group) -> str:
    root = _context(group, "memplan", None)
    sections = [HEADER, "## memplan\n", "```text", group.get_help(root), "```\n"]
    for name in sorted(group.list_commands(root)):
        command = group.get_command(root, name)
        assert command is not None
        sections += [f"## memplan {name}\n", "```text", command.get_help(_context(command, name, root)), "```\n"]
    return "\n".join(sections)


if __name__ == "__main__":
    from memplan.cli import main

    print(cli_reference(main), end="")
