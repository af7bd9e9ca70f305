"""How long a `memplan estimate` process takes to end once the command is done, with Python's own exit and with
memplan's (memplan.cli.run: atexit functions, a flush, os._exit).

Usage: python benchmarks/exit_teardown.py [--repeats 2]
Each run is a child process that runs the gpt2 estimate (-b 8 --seq-len 1024, cache off) through memplan.cli.main
or memplan.cli.run, with an atexit function that stamps the time the exit began; the figure is the wall time from
that stamp to the child's end, seen by this process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["estimate", "gpt2", "--batch-size", "8", "--seq-len", "1024", "--json", "--no-cache"]
CHILD = """
import atexit, sys, time
import memplan.cli
atexit.register(lambda: sys.stderr.write(f"EXIT-BEGAN {{time.time()}}\\n"))
sys.argv = ["memplan", *{args!r}]
memplan.cli.{entry}()
"""


def teardown_seconds(entry: str) -> float:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(args=ARGS, entry=entry)], capture_output=True, text=True, env=environment
    )
    ended = time.time()
    began = float(next(line for line in done.stderr.splitlines() if line.startswith("EXIT-BEGAN")).split()[1])
    return ended - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    repeats = parser.parse_args().repeats
    for entry, label in (("main", "Python's own exit"), ("run", "memplan's exit (memplan.cli.run)")):
        figures = ", ".join(f"{teardown_seconds(entry):.2f} s" for _ in range(repeats))
        print(f"{label}: {figures} from the atexit functions to the process's end")


if __name__ == "__main__":
    main()
