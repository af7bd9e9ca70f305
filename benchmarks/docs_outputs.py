"""Run every memplan command the docs show with its output, and compare (or rewrite) that output.

Usage (from the repository root):
    python benchmarks/docs_outputs.py [DOC.md ...]          # report which shown outputs drifted
    python benchmarks/docs_outputs.py --write [DOC.md ...]  # and rewrite them with today's output

A documented command is a ```bash block holding one `memplan ...` line (backslash continuations
joined) followed at once by a ```text block: that block is what the command prints. Each command
runs in a temporary folder (files it writes, such as --plot images, land there and are dropped),
with COLUMNS=120 so tables wrap as in the docs. The closing "N traces, ... s" and "N s" lines vary
from run to run and are left out of the comparison; everything else must match character for
character. Default docs: docs/walkthroughs.md. Exits 1 when an output drifted (without --write),
which is how CI (.ci/run) checks the docs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```bash\n(?P<command>memplan [^`]*?)\n```\n```text\n(?P<output>.*?)```\n", re.DOTALL)
VOLATILE = re.compile(r"^(\d+ traces?\b.*)?[\d.]+ s$", re.MULTILINE)


def _normalise(text: str) -> str:
    lines = [line.rstrip() for line in VOLATILE.sub("", text).splitlines()]
    return "\n".join(lines).rstrip() + "\n"


def run(command: str) -> str:
    words = command.replace("\\\n", " ").split()
    with tempfile.TemporaryDirectory() as folder:
        # The commands name files as a reader types them in a checkout (examples/ds_config_zero2.json).
        os.symlink(ROOT / "examples", Path(folder) / "examples")
        environment = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(ROOT), "TERM": "dumb", "MEMPLAN_NO_CACHE": "1"}
        done = subprocess.run(
            [sys.executable, "-m", "memplan", *words[1:]],
            cwd=folder,
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"{command!r} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def main() -> None:
    write = "--write" in sys.argv
    docs = [Path(arg) for arg in sys.argv[1:] if arg != "--write"] or [ROOT / "docs" / "walkthroughs.md"]
    drifted = 0
    for doc in docs:
        text = doc.read_text()
        pieces, position = [], 0
        for match in BLOCK.finditer(text):
            output = run(match.group("command"))
            same = _normalise(output) == _normalise(match.group("output"))
            drifted += not same
            first_line = match.group("command").splitlines()[0]
            print(f"{'same   ' if same else 'DRIFTED'} {doc.name}: {first_line}", flush=True)
            pieces.append(text[position : match.start("output")])
            pieces.append(match.group("output") if same or not write else _normalise(output))
            position = match.end("output")
        pieces.append(text[position:])
        if write:
            doc.write_text("".join(pieces))
    print(f"{drifted} drifted" + (" (rewritten)" if write and drifted else ""))
    if drifted and not write:
        raise SystemExit(1)  # CI's docs check (.ci/run) fails on a drifted output


if __name__ == "__main__":
    main()
