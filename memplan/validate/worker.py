"""`python -m memplan.validate.worker`: measure one configuration, isolated in its own process.

Reads one JSON request on stdin and prints one JSON line on stdout: the measurement, or
{"error": ...}. An OOM or a CUDA error ends this process only, never the suite that started it.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys

from memplan.errors import MemplanError
from memplan.estimator.collector import freeze_existing_objects


def _import_with_the_collector_off() -> None:
    """Import torch and what measuring needs with Python's cyclic collector off, then freeze what the
    imports made: they make about a million objects and hardly any garbage, and with the collector on
    each full collection walks all of them (memplan.cli.collector says the same of the command line).
    torch._dynamo is among them because every real step imports it anyway: torch.optim.Optimizer's
    constructor does (torch/_compile.py, its disable decorator). A tiny MLP's measurement took 3.1 s
    with the collector on through the imports and 1.7 s with this (2026-11-29, this 2-core machine).
    The measured iteration still collects first and holds the collector (memplan.measure.collector)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401

        import memplan.models.source  # noqa: F401
        import memplan.validate.measure  # noqa: F401
    finally:
        if enabled:
            gc.enable()
    freeze_existing_objects()


def main() -> int:
    request = json.loads(sys.stdin.read())
    # transformers' warnings would end in this process's stderr, whose last lines say why a measurement
    # died: quiet them as transformers reads its level at import (transformers.utils.logging), so that a
    # model without transformers does not import it (half a second of every such measurement)
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    _import_with_the_collector_off()
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings
    from memplan.validate.measure import measure

    try:
        settings = TrainingSettings.from_dict(request["settings"])
        spec = resolve_model(**request["model"])
        result = measure(spec, settings, warmup=request["warmup"], snapshot=request.get("snapshot"))
    except MemplanError as error:
        print(json.dumps({"error": str(error), "error_class": type(error).__name__}))
        return 1
    print(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
