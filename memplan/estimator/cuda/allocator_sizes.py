"""How much the CUDA caching allocator reserves for a request: c10/cuda/CUDACachingAllocator.cpp's
rounding (round_size, roundup_power2_next_division) and segment sizes (get_allocation_size), torch 2.x.
memplan.estimator.cuda.allocator's module docstring says how they are used."""

from __future__ import annotations

from memplan.estimator.cuda.alloc_conf import LARGE_SEGMENT_BYTES, MIN_LARGE_ALLOC_MB, AllocatorConfig, power_of_two

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer
MIN_LARGE_ALLOC_BYTES = MIN_LARGE_ALLOC_MB << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge


def round_size(num_bytes: int, config: AllocatorConfig | None = None) -> int:
    """round_size(): 512-byte blocks, or the next power-of-two division where configured."""
    if num_bytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = config.divisions_for(num_bytes) if config is not None else 0
    if divisions > 1 and num_bytes > MIN_BLOCK_BYTES * divisions:
        return _roundup_power2_next_division(num_bytes, divisions)
    return -(-num_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def _roundup_power2_next_division(num_bytes: int, divisions: int) -> int:
    """roundup_power2_next_division(): e.g. 1200 B in 4 divisions of 1024..2048 rounds to 1280."""
    if power_of_two(num_bytes):
        return num_bytes
    floor = 1 << (num_bytes.bit_length() - 1)
    # torch returns the next power of two where the step would be 0; round_size calls this only
    # above 512 B x divisions, where the step is 512 B or more.
    step = floor >> (divisions.bit_length() - 1)
    return -(-num_bytes // step) * step


def segment_size(rounded_bytes: int, large_segment_bytes: int = LARGE_SEGMENT_BYTES) -> int:
    """get_allocation_size(): how much one cudaMalloc asks for to serve this request (`large_segment_bytes`:
    large_segment_size_mb's, 20 MiB unless set)."""
    if rounded_bytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return large_segment_bytes
    return -(-rounded_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
