"""Wall time and peak RSS of whole `memplan estimate` processes, and MemTracker for comparison.

Usage: python benchmarks/bench_estimate.py [--only NAME] [--repeat N]
Each command runs as its own process under /usr/bin/time, so start-up (importing torch and
transformers) is included, as a user would experience it. memplan's answer cache is off for every
case but "gpt2-from-cache": the gpt2 command run twice on an empty cache, the second timed.

With --repeat N the cases run N times in turn (one round of every case, then the next), and a last
line gives each case's median wall time and issue 20's ratios from those medians where their cases
ran: gpt2 against MemTracker's whole process, the budget search and the 12-point sweep against one
gpt2 estimate. A single run of a 3-second process varies by ±10% on the 2-core machine; the medians
of interleaved rounds are what the targets are read from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMPLAN = [sys.executable, "-m", "memplan", "estimate"]
CASES = {
    "gpt2": MEMPLAN + ["gpt2", "--batch-size", "8", "--seq-len", "1024", "--json"],
    "gpt2-budget": MEMPLAN + ["gpt2", "--batch-size", "8", "--seq-len", "1024", "--budget", "24GiB", "--json"],
    "bert-large-uncased": MEMPLAN + ["bert-large-uncased", "--batch-size", "32", "--seq-len", "512", "--json"],
    "llama-2-7b": MEMPLAN
    + ["llama-2-7b", "--batch-size", "1", "--seq-len", "4096", "--precision", "amp-bf16", "--json"],
    "llama-3.1-70b": MEMPLAN
    + ["llama-3.1-70b", "--batch-size", "1", "--seq-len", "4096", "--precision", "amp-bf16", "--json"],
    "resnet-50": MEMPLAN + ["resnet-50", "--batch-size", "64", "--image-size", "224", "--json"],
    "memtracker-gpt2": [sys.executable, str(ROOT / "benchmarks" / "memtracker_step.py")],
    "gpt2-sweep-12": [sys.executable, "-m", "memplan", "sweep", "gpt2", "--seq-len", "1024"]
    + ["--batch-sizes", ",".join(map(str, range(1, 13))), "--json"],
    "gpt2-compare": [sys.executable, "-m", "memplan", "compare", "gpt2", "--batch-size", "8", "--seq-len", "1024"]
    + ["--json"],
}
CASES["gpt2-from-cache"] = CASES["gpt2"]
# One ZeRO-3 rank of small and large jobs: what the rank runs grows with its world size only where DeepSpeed loops
# over the ranks (memplan.distributed.deepspeed_collectives).
ZERO3 = ["--parallel", "zero3", "--json", "--world-size"]
for ranks in (8, 512):
    CASES[f"llama-3-8b-zero3-{ranks}"] = MEMPLAN + ["llama-3-8b", "-b", "1", "--seq-len", "512", *ZERO3, str(ranks)]
CASES["tiny-gpt2-zero3-1024"] = MEMPLAN + ["tiny-gpt2", "-b", "2", "--seq-len", "64", "--device", "cpu", *ZERO3, "1024"]


def run(name: str, command: list[str], environment: dict[str, str]) -> dict:
    started = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "MAXRSS_KB=%M", *command], capture_output=True, text=True, cwd=ROOT, env=environment
    )
    wall = time.perf_counter() - started
    rss = int(re.search(r"MAXRSS_KB=(\d+)", done.stderr).group(1)) * 1024
    row = {"name": name, "wall_s": round(wall, 2), "peak_rss_bytes": rss, "exit_code": done.returncode}
    if done.returncode == 0 and done.stdout.strip().startswith("{"):
        data = json.loads(done.stdout)
        if "rows" in data:  # a compare
            row.update(rows=len(data["rows"]))
        elif "series" in data:  # a sweep
            series = data["series"]
            row.update(points=sum(len(s["points"]) for s in series), traces=sum(s["traces"] for s in series))
        else:
            row.update(peak_bytes=data["peak_bytes"], traces=data["traces"], max_batch_size=data["max_batch_size"])
    elif done.returncode == 0:
        row["output"] = done.stdout.strip()
    else:
        row["error"] = done.stderr.strip().splitlines()[-1]
    return row


# issue 20's targets: (case, the case it is measured against, the most the ratio may be)
RATIOS = (("gpt2", "memtracker-gpt2", 0.5), ("gpt2-budget", "gpt2", 1.1), ("gpt2-sweep-12", "gpt2", 1.5))


def run_case(name: str) -> dict:
    if name == "gpt2-from-cache":
        with tempfile.TemporaryDirectory() as folder:
            environment = {**os.environ, "MEMPLAN_CACHE_DIR": folder}
            run(name, CASES[name], environment)  # answers and keeps the answer
            return run(name, CASES[name], environment)
    return run(name, CASES[name], {**os.environ, "MEMPLAN_NO_CACHE": "1"})


def medians(rows: list[dict]) -> dict:
    """Each case's median wall time, and the targets' ratios between the medians of the cases that ran."""
    walls: dict[str, list[float]] = {}
    for row in rows:
        walls.setdefault(row["name"], []).append(row["wall_s"])
    median = {name: round(statistics.median(values), 2) for name, values in walls.items()}
    ratios = {
        f"{case} / {against}": {"ratio": round(median[case] / median[against], 3), "target": target}
        for case, against, target in RATIOS
        if case in median and against in median
    }
    return {"rounds": max(map(len, walls.values()), default=0), "median_wall_s": median, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", action="append", choices=sorted(CASES))
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every case, in turn")
    arguments = parser.parse_args()
    names = arguments.only or list(CASES)
    rows = []
    for _ in range(max(arguments.repeat, 1)):
        for name in names:
            rows.append(run_case(name))
            print(json.dumps(rows[-1]), flush=True)
    if arguments.repeat > 1:
        print(json.dumps(medians(rows)), flush=True)


if __name__ == "__main__":
    main()
