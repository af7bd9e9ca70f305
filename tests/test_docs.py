"""The docs agree with the code: the generated CLI reference, and every memplan command line they show."""

import re
import shlex
from pathlib import Path

import click
import pytest

from memplan.cli import main
from memplan.render.cli_reference import cli_reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_cli_reference_is_in_sync():
    generated = cli_reference(main)
    on_disk = (ROOT / "docs" / "cli.md").read_text()
    assert on_disk == generated, "regenerate: python -m memplan.render.cli_reference > docs/cli.md"


def _command_lines():
    """`memplan ...` lines inside the docs' code blocks, with backslash continuations joined."""
    for path in DOCS:
        in_block = False
        pending = ""
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
                continue
            if not in_block:
                continue
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            text = re.sub(r"^\$ ", "", text)
            if text.startswith(("memplan ", "python -m memplan ")):
                yield path.name, text


COMMAND_LINES = list(_command_lines())


def test_docs_show_commands():
    assert len(COMMAND_LINES) >= 20


@pytest.mark.parametrize(("doc", "line"), COMMAND_LINES, ids=[f"{doc}:{line[:60]}" for doc, line in COMMAND_LINES])
def test_every_documented_command_parses(doc, line):
    """Each command's options and values are ones the CLI accepts (parsed, not run)."""
    command = line.split("#")[0] if " #" in line else line
    command = re.split(r"\s[|>]\s|\s2>", command)[0]
    words = shlex.split(command)
    words = words[3:] if words[:3] == ["python", "-m", "memplan"] else words[1:]
    if words[0].startswith("-"):  # an option of the group itself: --version, --help
        with pytest.raises(click.exceptions.Exit):
            main.make_context("memplan", words)
        return
    root = click.Context(main, info_name="memplan")
    sub = main.get_command(root, words[0])
    assert sub is not None, line
    try:
        sub.make_context(words[0], words[1:], parent=root)
    except click.exceptions.Exit:
        pass  # --help / --version


@pytest.mark.parametrize(("doc", "line"), COMMAND_LINES, ids=[f"{doc}:{line[:60]}" for doc, line in COMMAND_LINES])
def test_files_and_modules_the_documented_commands_read_are_shipped(doc, line):
    """A command a reader copies must find its inputs: --hf-args and --deepspeed files and examples.*
    modules exist."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    words = shlex.split(line.split(" #")[0])
    for flag, value in zip(words, words[1:], strict=False):
        if flag in ("--hf-args", "--deepspeed"):
            assert (root / value).is_file(), f"{doc}: {line}"
    for word in words:
        if word.startswith("examples.") and ":" in word:
            module, name = word.split(":", 1)
            assert (root / (module.replace(".", "/") + ".py")).is_file(), f"{doc}: {line}"


def test_the_readme_accuracy_table_has_a_row_for_every_zoo_case():
    """Each row's predicted figure is checked against memplan's trace where the zoo case is traced anyway
    (tests/test_accuracy_zoo.py, on the release the table names)."""
    from tests.readme_zoo import readme_zoo_rows
    from tests.zoo import ZOO_CASES

    assert set(readme_zoo_rows()) == {case.id for case in ZOO_CASES}, "regenerate: python benchmarks/zoo_accuracy.py"
