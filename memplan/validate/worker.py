"""`python -m memplan.validate.worker`: measure one configuration, isolated in its own process.

Reads one JSON request on stdin and prints one JSON line on stdout: the measurement, or
{"error": ...}. An OOM or a CUDA error ends this process only, never the suite that started it.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from memplan.errors import MemplanError
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from memplan.validate.measure import measure


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
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
