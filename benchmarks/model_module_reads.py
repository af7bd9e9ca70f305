"""What reading transformers' modeling modules costs a trace (memplan.estimator.model_modules): the lru-cache finder's
and the rotary-update finder's reads an estimate, and the time of one read in a process that has imported many model
families, as a test worker or a notebook that tried several models has.

Usage: python benchmarks/model_module_reads.py [--families N]   (default 150)
Imports transformers' first N modeling modules, then prints how many `transformers.models` modules are in the process,
the milliseconds of one read by each finder (medians of 50), and how many reads each finder made over one tiny-gpt2
estimate (`--device cpu`, one process: MEMPLAN_JOBS=1). docs/testing.md's figures came from this (2026-12-08).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", type=int, default=150)
    families = parser.parse_args().families
    os.environ["MEMPLAN_NO_CACHE"] = "1"
    os.environ["MEMPLAN_JOBS"] = "1"
    import transformers.models

    imported = 0
    for module in list(pkgutil.iter_modules(transformers.models.__path__))[:families]:
        try:
            importlib.import_module(f"transformers.models.{module.name}.modeling_{module.name}")
            imported += 1
        except Exception:  # noqa: BLE001 (a family missing a backend or an optional package: not counted)
            continue

    import memplan
    from memplan.estimator import hf_patches, model_modules, tensor_caches

    def read_time(finder: object) -> float:
        model_modules.found_in_model_modules(finder)  # (read each module once: later calls find it unchanged)
        times = []
        for _ in range(50):
            started = time.perf_counter()
            model_modules.found_in_model_modules(finder)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    modules = sum(name.startswith("transformers.models.") for name in sys.modules)
    print(f"{imported} modeling modules imported, {modules} transformers.models modules in the process")
    for finder in (tensor_caches._module_cache_cells, hf_patches._frequency_update_cells):
        print(f"one read by {finder.__name__}: {read_time(finder):.2f} ms")

    reads: dict[str, int] = {}
    original = model_modules.found_in_model_modules

    def counted(finder):  # noqa: ANN001, ANN202
        reads[finder.__name__] = reads.get(finder.__name__, 0) + 1
        return original(finder)

    memplan.estimate("tiny-gpt2", batch_size=4, seq_len=32, device="cpu")  # (warm: its modules imported)
    tensor_caches.found_in_model_modules = hf_patches.found_in_model_modules = counted
    memplan.estimate("tiny-gpt2", batch_size=4, seq_len=32, device="cpu")
    print(f"reads over one tiny-gpt2 estimate: {reads}")


if __name__ == "__main__":
    main()
