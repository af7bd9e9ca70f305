"""A dense tensor's memory format as ATen reads it from its strides (c10's `suggest_memory_format`), for the rules
whose kernels choose a path or a buffer's layout by it (CPU batch norm, cuDNN convolutions)."""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format as prims_suggest_memory_format

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}  # by dimension


def suggested_memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """Channels-last (channels-last-3d for 5-D) where the strides are that format's and not also the default's (a
    tensor contiguous both ways counts as contiguous), the default otherwise."""
    channels_last = _CHANNELS_LAST.get(tensor.dim())
    if channels_last is not None and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=channels_last):
        return channels_last
    return torch.contiguous_format


def empty_like_format(tensor: torch.Tensor) -> torch.memory_format:
    """The format ATen's CPU kernels that write `at::empty_like(t, is_contiguous(t) ? suggest_memory_format_contig(t)
    : t.suggest_memory_format())` give their output (batch_norm_cpu, Normalization.cpp, torch 2.11-2.14): for a
    tensor contiguous in a format, `suggested_memory_format`; otherwise `Tensor::suggest_memory_format()`, which reads
    the strides' order (`is_channels_last_strides_2d`/`_3d`, c10/core/MemoryFormat.h), not contiguity: a channels-last
    activation sliced along its width stays channels-last (torch._prims_common.suggest_memory_format, its Python
    twin)."""
    if contiguous_in_a_format(tensor):
        return suggested_memory_format(tensor)
    return prims_suggest_memory_format(tensor)


def contiguous_in_a_format(tensor: torch.Tensor) -> bool:
    """Contiguous in the default format or in the channels-last one of its dimension."""
    channels_last = _CHANNELS_LAST.get(tensor.dim())
    return tensor.is_contiguous() or (channels_last is not None and tensor.is_contiguous(memory_format=channels_last))


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `tensor`'s sizes, strides and dtype: what a rule runs an op on, narrows or tests for
    contiguity to read the layout and dtype the real kernel would give, without data."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
