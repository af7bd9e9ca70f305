"""memplan: will this training step fit on my GPU, and what do I change if it won't?"""

from memplan.api import estimate
from memplan.errors import MemplanError
from memplan.estimator.result import Breakdown, EstimateResult
from memplan.settings import TrainingSettings, format_bytes, parse_size

__all__ = [
    "Breakdown",
    "EstimateResult",
    "MemplanError",
    "TrainingSettings",
    "estimate",
    "format_bytes",
    "parse_size",
]
__version__ = "0.1.0"
