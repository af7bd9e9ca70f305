"""The largest-batch search beside one estimate: traces and seconds, from a tiny MLP to a 7B model.

Usage (from the repository root):  python benchmarks/bench_search.py [--skip-7b]

For each model and target, `estimate` alone (two traces, for the per-sample slope) and
`estimate --budget B`, where B is four times the estimate's own fit figure (reserved on cuda),
so the answer lies well above the batch asked for. Prints a markdown table; issue target: the
search costs at most 2x one estimate.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.utils import logging  # noqa: E402

import memplan  # noqa: E402

CASES = [
    (
        "tests.zoo_models:reused_block",
        {"inputs": "tests.zoo_models:features_inputs", "loss": "tests.zoo_models:mean_square_loss", "batch_size": 64},
    ),
    ("tiny-gpt2", {"batch_size": 4, "seq_len": 128}),
    ("gpt2", {"batch_size": 4, "seq_len": 512}),
    ("bert-large-uncased", {"batch_size": 8, "seq_len": 512}),
    ("llama-2-7b", {"batch_size": 1, "seq_len": 1024, "precision": "amp-bf16", "checkpoint": "all"}),
]


def main() -> None:
    logging.set_verbosity_error()
    skip_7b = "--skip-7b" in sys.argv
    memplan.estimate("tiny-gpt2", device="cpu", seq_len=32)  # imports and first-call costs, not timed
    print("| model | target | estimate: traces, s | with --budget 4x: traces, s | ratio | largest batch |")
    print("| --- | --- | --- | --- | ---: | ---: |")
    for model, settings in CASES:
        if skip_7b and "7b" in model:
            continue
        for device in ("cpu", "cuda"):
            started = time.perf_counter()
            alone = memplan.estimate(model, device=device, **settings)
            alone_seconds = time.perf_counter() - started
            budget = 4 * alone.fit_bytes
            started = time.perf_counter()
            searched = memplan.estimate(model, device=device, budget=budget, **settings)
            search_seconds = time.perf_counter() - started
            largest = (
                f"≥ {searched.max_batch_size:,}" if searched.max_batch_size_is_limit else f"{searched.max_batch_size:,}"
            )
            print(
                f"| {model} | {device} | {alone.traces}, {alone_seconds:.1f} | "
                f"{searched.traces}, {search_seconds:.1f} | {search_seconds / alone_seconds:.2f} | {largest} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
