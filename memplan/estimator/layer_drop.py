"""LayerDrop (https://huggingface.co/papers/1909.11556) as transformers writes it: a uniform draw compared with the drop
rate, read by an `if` in the stack's forward,

    dropout_probability = torch.rand([])
    if dropout_probability < self.layerdrop:  # skip the layer

(BART, Whisper, Pegasus, mBART, Marian, LED, PLBart, M2M-100, ...; on transformers 5.17 in every training forward,
on 5.25 only where the rate is above 0) or `skip_the_layer = self.training and dropout_probability <
self.config.layerdrop` (wav2vec2, HuBERT, WavLM, ...). Under fake tensors the draw has no value, and the `if` made the
step untraceable: a BART seq2seq step could not be estimated at all on transformers 5.17. While a step is traced, a
0-dim draw of `torch.rand` compared below a number in transformers' modelling code reads False: every layer runs, the
step that holds the most (with a rate of 0, the only step a real run takes). The draw and the comparison still run, as
in a real run: their bytes are counted. Any other value read is refused as before, a draw compared elsewhere too
(whose `<` may mean "keep", not "drop").
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from numbers import Real
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakTensorKeyDictionary

# Where transformers' modelling code lives (transformers/models/<family>/modeling_<family>.py), whose LayerDrop this is.
_TRANSFORMERS_MODELS = f"{os.sep}transformers{os.sep}models{os.sep}"


@contextlib.contextmanager
def layers_never_dropped() -> Iterator[None]:
    draws = WeakTensorKeyDictionary()  # 0-dim uniform draws made while the block runs
    below = WeakTensorKeyDictionary()  # a draw's comparison below a number
    rand, less_than, read = torch.rand, torch.Tensor.__lt__, FakeTensor.__bool__

    def rand_(*args: Any, **kwargs: Any) -> Any:
        out = rand(*args, **kwargs)
        if isinstance(out, FakeTensor) and out.dim() == 0:
            draws[out] = True
        return out

    def less_than_(self: torch.Tensor, other: Any) -> Any:
        out = less_than(self, other)
        if isinstance(other, Real) and self in draws and _TRANSFORMERS_MODELS in sys._getframe(1).f_code.co_filename:
            below[out] = True
        return out

    def bool_(self: torch.Tensor) -> bool:
        return False if self in below else read(self)

    with (
        patch.object(torch, "rand", rand_),
        patch.object(torch.Tensor, "__lt__", less_than_),
        patch.object(FakeTensor, "__bool__", bool_, create=True),
    ):
        yield
