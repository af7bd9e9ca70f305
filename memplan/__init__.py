"""memplan: will this training step fit on my GPU, and what do I change if it won't?"""

from memplan.api import apply_plan, compare, estimate, plan, plan_batch, sweep, validate, validate_suite
from memplan.errors import MemplanError
from memplan.estimator.result import Breakdown, EstimateResult
from memplan.hf_args import read_training_args
from memplan.planner.plan import PlanResult
from memplan.settings import CheckpointLayout, TrainingSettings, format_bytes, parse_size
from memplan.validate.result import ValidationResult

__all__ = [
    "Breakdown",
    "CheckpointLayout",
    "PlanResult",
    "apply_plan",
    "compare",
    "plan",
    "plan_batch",
    "EstimateResult",
    "MemplanError",
    "TrainingSettings",
    "estimate",
    "format_bytes",
    "parse_size",
    "read_training_args",
    "sweep",
    "validate",
    "validate_suite",
    "ValidationResult",
]
__version__ = "0.1.0"
