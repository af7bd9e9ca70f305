"""cuBLAS workspaces: their size per compute capability and under CUBLAS_WORKSPACE_CONFIG.

aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.11-2.14), `parseChosenWorkspaceSize`: without
CUBLAS_WORKSPACE_CONFIG the workspace is ":4096:8" (32 MiB) on Hopper and Blackwell, compute
capability major 9, 10 or 12 (`use32mb`, since pytorch/pytorch#175344 of February 2026, which re-
enabled Blackwell; before it sm90 alone), and ":4096:2:16:8" (8.125 MiB) elsewhere. With it, every
":SIZE:COUNT" pair the regex `:([0-9]+):([0-9]+)` finds adds SIZE KiB x COUNT; a value with no such
pair makes torch warn and use the default. One workspace is allocated through the caching allocator
per (handle, stream), i.e. per thread that multiplies matrices, and kept.
`torch.use_deterministic_algorithms(True)` needs the value to be ":4096:8" or ":16:8" (Context.cpp
`checkCuBLASConfigDeterministic`); transformers' `full_determinism` sets ":16:8".

Torch-free, so that settings can check a value without importing torch.
"""

from __future__ import annotations

import re

HOPPER_DEFAULT = ":4096:8"
DEFAULT = ":4096:2:16:8"
DETERMINISTIC_CONFIGS = (":4096:8", ":16:8")
_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def config_bytes(config: str) -> int | None:
    """Bytes a CUBLAS_WORKSPACE_CONFIG value asks for; None where torch finds no ":SIZE:COUNT" pair."""
    pairs = _PAIR.findall(config)
    if not pairs:
        return None
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublas_workspace_bytes(compute_capability: tuple[int, int], config: str | None = None) -> int:
    """One cuBLAS workspace: the configured size, else the default for the compute capability."""
    configured = config_bytes(config) if config is not None else None
    if configured is not None:
        return configured
    default = HOPPER_DEFAULT if compute_capability[0] in (9, 10, 12) else DEFAULT
    return config_bytes(default) or 0
