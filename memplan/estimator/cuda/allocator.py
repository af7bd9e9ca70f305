"""PyTorch's CUDA caching allocator, simulated over a predicted sequence of allocations and frees.

The rules and constants are c10/cuda/CUDACachingAllocator.cpp's defaults (torch 2.x; no
PYTORCH_CUDA_ALLOC_CONF, so no max_split_size, no expandable segments, no garbage collection):

- every request is rounded up to a multiple of kMinBlockSize = 512 bytes (round_size);
- requests of at most kSmallSize = 1 MiB come from the small pool, larger ones from the large pool;
- a request that no cached free block can hold gets a new segment (cudaMalloc) of
  get_allocation_size(): kSmallBuffer = 2 MiB for small requests, kLargeBuffer = 20 MiB for
  requests below kMinLargeAlloc = 10 MiB, otherwise the request rounded up to kRoundLarge = 2 MiB;
- the free block chosen is the best fit: the smallest one that holds the request, the lowest
  address among equals (the pool is a set ordered by size, then address);
- a block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB (large
  pool); the request takes the front; an unsplit block is handed out whole and counted whole in
  memory_allocated;
- a freed block merges with free neighbours of its segment; segments are never released within a
  step (cudaFree happens only when a cudaMalloc fails or on empty_cache()).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge


def round_size(num_bytes: int) -> int:
    if num_bytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return -(-num_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def segment_size(rounded_bytes: int) -> int:
    """get_allocation_size(): how much one cudaMalloc asks for to serve this request."""
    if rounded_bytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-rounded_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class _Pool:
    free: list[tuple[int, int]] = field(default_factory=list)  # (size, address), sorted
    by_key: dict[tuple[int, int], _Block] = field(default_factory=dict)

    def add(self, block: _Block) -> None:
        key = (block.size, block.address)
        bisect.insort(self.free, key)
        self.by_key[key] = block

    def remove(self, block: _Block) -> None:
        key = (block.size, block.address)
        del self.free[bisect.bisect_left(self.free, key)]
        del self.by_key[key]

    def best_fit(self, size: int) -> _Block | None:
        index = bisect.bisect_left(self.free, (size, -1))
        if index == len(self.free):
            return None
        block = self.by_key[self.free[index]]
        self.remove(block)
        return block


class CachingAllocator:
    """One device, one stream. `malloc` returns a handle for `free`; statistics as torch.cuda names them."""

    def __init__(self) -> None:
        self._pools = {True: _Pool(), False: _Pool()}
        self._next_address = 0
        self._handles: dict[int, _Block] = {}
        self._next_handle = 0
        self._segment_heads: list[_Block] = []
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.segments = 0
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0

    def malloc(self, num_bytes: int) -> int:
        size = round_size(num_bytes)
        small = size <= SMALL_REQUEST_BYTES
        pool = self._pools[small]
        block = pool.best_fit(size)
        if block is None:
            block = self._new_segment(segment_size(size), small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_BYTES:
            rest = _Block(block.address + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.allocated = True
        self.allocated_bytes += block.size
        self.max_allocated_bytes = max(self.max_allocated_bytes, self.allocated_bytes)
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = block
        return handle

    def free(self, handle: int) -> None:
        block = self._handles.pop(handle)
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = self._pools[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        pool.add(block)

    def _new_segment(self, size: int, small: bool) -> _Block:
        block = _Block(self._next_address, size, small)
        self._segment_heads.append(block)
        self._next_address += size
        self.reserved_bytes += size
        self.segments += 1
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
        return block

    def block(self, handle: int) -> tuple[int, int]:
        """(address, size) of a live allocation; size is what memory_allocated counts for it."""
        block = self._handles[handle]
        return block.address, block.size

    def segment_layout(self) -> list[tuple[int, int, bool, list[tuple[int, int, int | None]]]]:
        """Every segment as (address, size, small, blocks), each block (address, size, live handle or None)."""
        handle_of = {id(block): handle for handle, block in self._handles.items()}
        result = []
        for head in self._segment_heads:
            blocks = []
            block: _Block | None = head
            while block is not None:
                blocks.append((block.address, block.size, handle_of.get(id(block))))
                block = block.next
            result.append((head.address, sum(size for _, size, _ in blocks), head.small, blocks))
        return result

    def reset_peak_stats(self) -> None:
        """torch.cuda.reset_peak_memory_stats(): peaks restart from the current values."""
        self.max_allocated_bytes = self.allocated_bytes
        self.max_reserved_bytes = self.reserved_bytes
