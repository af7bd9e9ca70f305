"""Where the test suite's time goes: each test's CPU seconds, its own and its child processes', as a pytest plugin.

    PYTHONPATH=benchmarks MEMPLAN_NO_CACHE=1 python -m pytest -n 2 -q -p no:cacheprovider -p suite_cpu_times
    python benchmarks/suite_cpu_times.py            # the summary of what the run wrote

Each pytest process (xdist's workers too) appends one line a test to /tmp/memplan_suite_cpu_<worker>.tsv: the node
id, its own CPU seconds and those of the child processes it waited for (`resource.getrusage`), and its wall seconds.
It also writes /tmp/memplan_suite_gc_<worker>.tsv as it ends: the seconds Python's cyclic collector took through the
run (gc.callbacks), and the objects, the garbage and the seconds of one full collection at the end, made just before
pytest's own (its unraisableexception plugin collects at unconfigure) and leaving that one nothing to do.
Remove those files before a run. docs/testing.md's account of the suite's time came from this (2026-12-07, -08).
"""

from __future__ import annotations

import gc
import glob
import os
import resource
import sys
import time
from collections import defaultdict

import pytest

_PATTERN = "/tmp/memplan_suite_cpu_{}.tsv"
_GC_PATTERN = "/tmp/memplan_suite_gc_{}.tsv"
_collecting = {"seconds": 0.0, "started": 0.0}


def _timed_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _collecting["started"] = time.perf_counter()
    else:
        _collecting["seconds"] += time.perf_counter() - _collecting["started"]


gc.callbacks.append(_timed_collection)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):  # noqa: ANN001, ANN201 (pytest's hook)
    during = _collecting["seconds"]
    objects = len(gc.get_objects())
    started = time.perf_counter()
    garbage = gc.collect()
    with open(_GC_PATTERN.format(os.environ.get("PYTEST_XDIST_WORKER", "main")), "a") as out:
        out.write(f"{during:.2f}\t{objects}\t{garbage}\t{time.perf_counter() - started:.2f}\n")


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201 (pytest's hook)
    own, children, wall = _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN), time.time()
    yield
    own = _cpu_seconds(resource.RUSAGE_SELF) - own
    children = _cpu_seconds(resource.RUSAGE_CHILDREN) - children
    with open(_PATTERN.format(os.environ.get("PYTEST_XDIST_WORKER", "main")), "a") as out:
        out.write(f"{item.nodeid}\t{own:.2f}\t{children:.2f}\t{time.time() - wall:.2f}\n")


def main() -> int:
    rows = []
    for path in glob.glob(_PATTERN.format("*")):
        with open(path) as lines:
            for line in lines:
                node, own, children, _ = line.rstrip("\n").split("\t")
                rows.append((node, float(own), float(children)))
    if not rows:
        print(f"nothing written yet ({_PATTERN.format('*')}): run pytest with this plugin first", file=sys.stderr)
        return 1
    total = sum(own + children for _, own, children in rows)
    slow = [own + children for _, own, children in rows if own + children >= 0.3]
    print(f"{len(rows)} tests, {total:.0f} CPU s, {sum(c for _, _, c in rows):.0f} of them in child processes")
    print(f"{len(slow)} tests of 0.3 s or more: {sum(slow):.0f} CPU s")
    by_file: dict[str, float] = defaultdict(float)
    for node, own, children in rows:
        by_file[node.split("::")[0]] += own + children
    for path, seconds in sorted(by_file.items(), key=lambda item: -item[1])[:15]:
        print(f"{seconds:8.1f}  {path}")
    for path in sorted(glob.glob(_GC_PATTERN.format("*"))):
        with open(path) as lines:
            for line in lines:
                during, objects, garbage, last = line.split()
                print(
                    f"{path}: collector {float(during):.1f} s through the run; at its end {int(objects):,} objects, "
                    f"{int(garbage):,} of them garbage, collected in {float(last):.2f} s"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
