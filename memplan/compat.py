"""Which torch releases memplan runs on, and the one-line refusal of any other.

memplan emulates PyTorch internals that change between releases (autocast op lists, SDPA backend
rules, autograd's engine, fake-tensor kernels), so it supports the releases its tests have run on:
torch 2.11 to 2.14 (CI runs the suite on 2.13 and a representative subset on 2.11; 2.14.1 was run
by hand, see docs/validation.md). A release outside the range is refused before any work rather
than answered with numbers nobody checked. `MEMPLAN_ALLOW_UNSUPPORTED_TORCH=1` lets it run anyway.
"""

from __future__ import annotations

import os
import re

from memplan.errors import UnsupportedTorchError

OLDEST_TORCH = (2, 11)  # the oldest release tested
NEWEST_TORCH = (2, 14)  # the newest release tested; later ones are refused until tested
ALLOW_ENVIRONMENT_VARIABLE = "MEMPLAN_ALLOW_UNSUPPORTED_TORCH"


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.11.0+cu130' or '2.14.0a0+git1234'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedTorchError(f"cannot read the torch version {version!r}; install torch 2.11 to 2.14")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str) -> None:
    """Raise UnsupportedTorchError when `version` is outside the tested range."""
    release = torch_release(version)
    if OLDEST_TORCH <= release <= NEWEST_TORCH:
        return
    oldest, newest = (".".join(map(str, part)) for part in (OLDEST_TORCH, NEWEST_TORCH))
    raise UnsupportedTorchError(
        f"torch {version} is not supported: memplan is tested on torch {oldest} to {newest}; "
        f"install one of those (pip install 'torch>={oldest},<{NEWEST_TORCH[0]}.{NEWEST_TORCH[1] + 1}') "
        f"or set {ALLOW_ENVIRONMENT_VARIABLE}=1 to run on untested numbers"
    )


def require_supported_torch() -> None:
    """Refuse the installed torch when it is outside the tested range (imports torch)."""
    if os.environ.get(ALLOW_ENVIRONMENT_VARIABLE) == "1":
        return
    try:
        import torch
    except ImportError as error:
        raise UnsupportedTorchError(f"torch cannot be imported ({error}); install torch 2.11 to 2.14") from error
    check_torch_version(torch.__version__)
