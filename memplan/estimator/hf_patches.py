"""Make transformers take, under fake tensors, the same code path a real run takes (design.md §3).

transformers checks tensor *values* in a few places and, seeing a fake tensor, assumes the worst:
`find_packed_sequence_indices` keeps a packed-sequence mask (a real run of an unpacked batch gets
None and SDPA's is_causal path), which changed Llama's attention path and its memory.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor


@contextlib.contextmanager
def real_run_paths() -> Iterator[None]:
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    original = masking.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor):
            # memplan's batches are never packed: the real check returns None for them.
            return None
        return original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


@contextlib.contextmanager
def no_weight_init() -> Iterator[None]:
    """Make torch.nn.init's in-place initialisers no-ops while building under fake tensors.

    Initialisation only sets values, which fake tensors don't have, and some initialisers branch on
    them (`trunc_normal_` loops until no sample is rejected).
    """
    import torch.nn.init as init

    originals = {
        name: getattr(init, name)
        for name in dir(init)
        if name.endswith("_") and not name.startswith("_") and callable(getattr(init, name))
    }
    hf_table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    hf_originals = dict(hf_table) if isinstance(hf_table, dict) else {}

    def keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    for name in originals:
        setattr(init, name, keep)
    for name in hf_originals:
        hf_table[name] = keep  # type: ignore[index]
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(init, name, function)
        for name, function in hf_originals.items():
            hf_table[name] = function  # type: ignore[index]
