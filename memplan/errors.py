"""Every error memplan raises on purpose is a `MemplanError`.

`exit_code` follows the CLI convention: 2 for a usage mistake (the user can fix the command line),
1 for a failure of the work itself (a model that cannot be traced, a measurement that failed).
"""

from __future__ import annotations


class MemplanError(Exception):
    """Base class; `str(error)` is a one-line message saying what is wrong and what to do."""

    exit_code: int = 1


class UsageError(MemplanError):
    """The command line or API call asked for something invalid."""

    exit_code = 2


class SettingsError(UsageError):
    """A training setting is out of range (batch size, accumulation, precision, ...)."""


class SizeParseError(UsageError):
    """A memory size such as `24GiB` could not be parsed."""


class UnknownModelError(UsageError):
    """A model name is neither a preset, a transformers model type, a config path nor a cached hub id."""


class ImportPathError(UsageError):
    """A `package.module:callable` path could not be imported or does not name a callable."""


class InputsError(UsageError):
    """An inputs function has the wrong signature or returned something that is not a batch."""


class LossError(UsageError):
    """No loss could be derived from the model output."""


class TraceError(MemplanError):
    """The training step could not be captured (data-dependent control flow, `.item()`, ...)."""


class MeasurementError(MemplanError):
    """A real run used for validation failed."""


class PlanFileError(UsageError):
    """A checkpointing plan file is unreadable, of another format version, or made for another setup."""


class OutputError(UsageError):
    """A file the user asked for (--plot, --snapshot, --output) cannot be written there."""


class HfArgsError(UsageError):
    """A TrainingArguments file is unreadable or asks for something memplan cannot model."""


class UnsupportedTorchError(MemplanError):
    """The installed torch is outside the releases memplan is tested on (memplan.compat)."""


class UserCodeError(MemplanError):
    """The user's own model factory or inputs function raised while memplan called it."""


def a_type(value: object) -> str:
    """The value's type with its article, for messages: "an int", "a str", "an OrderedDict"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
