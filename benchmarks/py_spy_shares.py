"""Where a sampled run's time went: a py-spy raw profile's samples shared out by the first of a list of functions on
their stacks (the whole test suite's: docs/testing.md).

    MEMPLAN_NO_CACHE=1 py-spy record --subprocesses -r 40 -f raw -o suite.txt -- \
        python -m pytest -n 2 -q -p no:cacheprovider
    python benchmarks/py_spy_shares.py suite.txt
    python benchmarks/py_spy_shares.py suite.txt --within "trace_step ("   # by file, inside the traces

Each sample counts once, in the first category whose pattern is part of its stack, in the order below (a forked child's
trace counts as the forked job's, a trace inside a simulation's caller as the trace's); the rest is "other". With
`--within PATTERN`, the samples whose stacks hold PATTERN instead, by the file of the function running when sampled (its
own time, the last frame).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

# (category, a substring of a stack frame as py-spy writes it: "function (path:line)")
CATEGORIES = [
    ("forked jobs", "ForkedJob"),
    ("traces of the step", "trace_step ("),
    ("the planner", "memplan/planner/"),
    ("simulations", "simulate ("),
    ("building the fake model and optimizer", "build_fake_setup"),
    ("the real runs tests measure", "memplan/measure/"),
    ("the validator", "memplan/validate/"),
    ("imports", "_find_and_load"),
    ("collection", "pytest_collect"),
]


def shares(path: str, within: str | None) -> tuple[Counter[str], int]:
    counted: Counter[str] = Counter()
    total = 0
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit() or (within is not None and within not in stack):
                continue
            total += int(count)
            if within is None:
                category = next((name for name, pattern in CATEGORIES if pattern in stack), "other")
            else:  # "function (path:line)": the path's last two parts
                last = stack.split(";")[-1]
                category = "/".join(last.rpartition("(")[2].split(":")[0].split("/")[-2:])
            counted[category] += int(count)
    return counted, total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile", help="py-spy record -f raw's output")
    parser.add_argument("--within", help="only the samples whose stacks hold this, by the running function's file")
    arguments = parser.parse_args()
    counted, total = shares(arguments.profile, arguments.within)
    if not total:
        print(f"no samples in {arguments.profile}", file=sys.stderr)
        return 1
    for name, samples in counted.most_common(None if arguments.within is None else 15):
        print(f"{100 * samples / total:5.1f}%  {name}")
    print(f"{total:,} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
