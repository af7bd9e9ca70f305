"""A one-element tensor the step makes with `torch.full` of a Python number keeps that value under fake tensors.

ModernBERT's multiple-choice head picks each flattened choice's <cls> token with a 0-d tensor index where no attention
mask is given: `cls_mask = torch.full((), 0, dtype=torch.long, ...)` then `last_hidden_state[indices_0, cls_mask]`
(transformers/models/modernbert/modeling_modernbert.py, ModernBertForMultipleChoice.forward). torch's indexing reads
a 0-d integer index's value (`.item()`, torch/csrc/autograd/python_variable_indexing.cpp, applySlicing) and selects
with it; under fake tensors that value did not exist, and the step was refused as data-dependent. Its value is the
fill the call names: given to the fake tensor as FakeTensorMode's `constant` (a real tensor of the same values, as
memplan.estimator.known_values keeps a batch's), which torch's fake mode reads where an op needs it (`.item()`) and
drops where an op writes the tensor (FakeTensorMode.invalidate_written_to_constants). Only one-element fills: their
values cost nothing to keep, and no other is read this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes


def _one_element_fills_known(plain: Any) -> Any:
    def full(size: Any, fill_value: Any, *args: Any, **kwargs: Any) -> Any:
        out = plain(size, fill_value, *args, **kwargs)
        fresh = "out" not in kwargs  # (`out=` fills a tensor made elsewhere, perhaps a view: no value of its own)
        if fresh and isinstance(out, FakeTensor) and out.numel() == 1 and isinstance(fill_value, bool | int | float):
            if out.constant is None:  # (a mode that keeps values made it with them: memplan.estimator.known_values)
                with _disable_current_modes():
                    out.constant = plain(tuple(out.shape), fill_value, dtype=out.dtype)
                # registered as torch registers its own constants, so that an op writing the tensor drops the value
                # (FakeTensorConverter.invalidate_constant_aliases reads this map)
                out.fake_mode.fake_tensor_converter.add_constant_storage_mapping(out)
        return out

    return full


@contextlib.contextmanager
def one_element_fills_known() -> Iterator[None]:
    """While a step is traced: `torch.full` of one element of a Python number carries its value (module docstring)."""
    with patch.object(torch, "full", _one_element_fills_known(torch.full)):
        yield
