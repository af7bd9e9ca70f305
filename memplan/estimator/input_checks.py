"""Input checks that read a tensor's values, answered as a run that trains answers them.

`F.gaussian_nll_loss` (torch/nn/functional.py, torch 2.11-2.14) checks `if torch.any(var < 0): raise ValueError(...)`.
Under fake tensors the value is unknown and the `if` cannot be traced (memplan refused the loss as depending on
tensor values, a helper's bug hunt), but a step that trains took the branch that does not raise. While a step is
traced, the check's ops run (their memory is counted: the comparison's boolean tensor and the reduction's scalar,
freed after the check, as in a real run) and the check reads False. `torch.any` answers so only where the checking
function itself calls it (no wrapper frame, which would hold the function's arguments past their real lifetime).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import torch
import torch.nn.functional as F

# The functions whose `torch.any(...)` is a check that raises where it finds anything.
_CHECKING_FUNCTIONS = ("gaussian_nll_loss",)


@contextlib.contextmanager
def input_checks_passing() -> Iterator[None]:
    checking = {getattr(F, name).__code__ for name in _CHECKING_FUNCTIONS}
    original = torch.any

    def any_(*args: Any, **kwargs: Any) -> Any:
        found = original(*args, **kwargs)
        return False if sys._getframe(1).f_code in checking else found

    with patch.object(torch, "any", any_):
        yield
