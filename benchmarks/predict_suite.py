"""Predict every configuration of a validation suite on the cuda target, without measuring.

A check that the CUDA emulation traces every suite model (no errors, no unsupported ops), and
the predictions a GPU run of `memplan validate --suite NAME` will be compared with.

    python benchmarks/predict_suite.py [main|smoke] [--max-batch N]
"""

from __future__ import annotations

import sys
import time

from transformers.utils import logging

import memplan
from memplan.validate.suite import suite_named

logging.set_verbosity_error()
name = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "main"
max_batch = int(sys.argv[sys.argv.index("--max-batch") + 1]) if "--max-batch" in sys.argv else None
for config in suite_named(name):
    settings = dict(config.settings)
    if max_batch is not None:
        settings["batch_size"] = min(settings.get("batch_size", 1), max_batch)
    started = time.perf_counter()
    try:
        result = memplan.estimate(config.model, device="cuda", **settings)
    except memplan.MemplanError as error:
        print(f"{config.id:32s} FAILED: {error}", flush=True)
        continue
    print(
        f"{config.id:32s} b{settings.get('batch_size', 1):<3d} peak {result.peak_bytes / 2**30:7.3f} GiB  "
        f"reserved {result.reserved_peak_bytes / 2**30:7.3f} GiB  unsupported {list(result.unsupported_ops)}  "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
