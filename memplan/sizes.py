"""Memory sizes as users write them (`24GiB`, `80GB`) and as memplan prints them (binary units)."""

from __future__ import annotations

import numbers
import re
from fractions import Fraction

from memplan.errors import SizeParseError, UsageError, a_type

# The largest size memplan takes: an int64's, as torch.cuda counts bytes (8 EiB, more than any device).
MAX_SIZE_BYTES = 2**63 - 1

# Binary and decimal units; "GB" is 10**9 as disks and nvidia-smi's marketing sizes use it,
# "GiB" is 2**30 as torch.cuda reports it.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, allow_zero: bool = False) -> int:
    """Parse `80GB`, `24GiB`, `512MiB`, `1.5 GiB` or plain bytes into a byte count; with `allow_zero`, 0 too
    (bytes held outside the allocator, such as the CUDA context, can be none)."""
    least = 0 if allow_zero else 1
    if isinstance(text, int) and not isinstance(text, bool):
        if text < least:
            raise SizeParseError(f"size must be {'0 or more' if allow_zero else 'positive'}, got {text}")
        return _at_most_max(text, text)
    match = _SIZE_RE.match(str(text))
    if isinstance(text, bool) or not match or match.group(2).lower() not in _UNITS:
        raise SizeParseError(f"cannot read {text!r} as a size; write e.g. 24GiB, 80GB, 512MiB or a number of bytes")
    # Exact: a float would turn 400 digits into infinity and round 9007199254740993 bytes to ...992.
    value = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1 and not (allow_zero and value == 0):
        raise SizeParseError(f"size must be {'0 or ' if allow_zero else ''}at least one byte, got {text!r}")
    if match.group(2).lower() in ("", "b") and value.denominator != 1:
        # `--budget 1.5` had been read as 1 byte: a fraction of a byte is a unit left out (1.5GiB), not a size
        raise SizeParseError(f"{text!r} is not a whole number of bytes; add the unit it means, e.g. {text}GiB")
    return _at_most_max(int(value), text)


def _at_most_max(num_bytes: int, text: str | int) -> int:
    if num_bytes > MAX_SIZE_BYTES:
        shown = text if len(str(text)) <= 30 else f"{str(text)[:27]}..."
        raise SizeParseError(f"size {shown!r} is larger than any device: memplan takes at most {MAX_SIZE_BYTES:,} B")
    return num_bytes


def format_bytes(num_bytes: float) -> str:
    """Binary units, as torch.cuda and memory_viz print them."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, numbers.Real):
        raise UsageError(f"format_bytes takes a number of bytes (an int or a float); got {a_type(num_bytes)}")
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:,.0f} {unit}" if unit == "B" else f"{sign}{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
