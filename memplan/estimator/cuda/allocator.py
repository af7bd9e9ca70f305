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

With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the same file's expandable-segment path
places blocks instead (memplan.estimator.cuda.allocator_expandable).

The other options of PYTORCH_CUDA_ALLOC_CONF that shape device memory (parsed as
c10/core/AllocatorConfig.cpp does, torch 2.11-2.14):
- `max_split_size_mb` (>= 20): a cached free block of at least that size is an "oversize" block.
  get_free_block hands one to a request below the limit never, and to a request at or above it
  only when the block is less than `max_non_split_rounding_mb` (default 20 MiB) larger; a large
  block is split only for a request below the limit (should_split);
- `roundup_power2_divisions`: a request above 512 B x divisions is rounded up to the next of
  `divisions` equal steps between two powers of two (round_size, roundup_power2_next_division),
  the divisions chosen per power-of-two interval from 1 MiB to 64 GiB (a single number for all,
  or `[MB:divisions,...,>:divisions]`);
- `garbage_collection_threshold` acts only in a process that set
  torch.cuda.set_per_process_memory_fraction (malloc: `set_fraction &&` the threshold), which a
  plain training step does not: it changes nothing here.

On a device of limited memory (`capacity_bytes`), the allocator's answer to a failed cudaMalloc
is simulated too (DeviceCachingAllocator::malloc): release_available_cached_blocks frees cached
oversize segments (the smallest one that holds the request, else the largest ones until enough
is freed; nothing without max_split_size_mb) and the cudaMalloc is tried again; then
release_cached_blocks frees every cached segment that is wholly free, and it is tried once more;
if that fails too, the step runs out of memory (OutOfMemory).
"""

from __future__ import annotations

import bisect

from memplan.estimator.cuda.alloc_conf import DEFAULT_CONFIG, AllocatorConfig, parse_alloc_conf
from memplan.estimator.cuda.allocator_blocks import Block, FreePool, PoolKey, UnmappedRanges
from memplan.estimator.cuda.allocator_expandable import ExpandableSegments, OutOfMemory
from memplan.estimator.cuda.allocator_sizes import (
    MIN_BLOCK_BYTES,
    ROUND_LARGE_BYTES,
    SMALL_REQUEST_BYTES,
    round_size,
    segment_size,
)

__all__ = [
    "DEFAULT_CONFIG",
    "ROUND_LARGE_BYTES",
    "AllocatorConfig",
    "CachingAllocator",
    "OutOfMemory",
    "parse_alloc_conf",
    "round_size",
    "segment_size",
]


class CachingAllocator(ExpandableSegments):
    """One device. `malloc` returns a handle for `free`; statistics as torch.cuda names them.

    Each stream has its own pools (a block freed on one stream is cached for that stream only);
    running out of memory releases what every stream has cached, as release_cached_blocks does."""

    def __init__(self, config: AllocatorConfig = DEFAULT_CONFIG, capacity_bytes: int | None = None) -> None:
        self.config = config
        self.capacity_bytes = capacity_bytes  # None: as much memory as the step asks for
        self._pools: dict[PoolKey, FreePool] = {}
        self._unmapped: dict[PoolKey, UnmappedRanges] = {}  # expandable segments only
        self._next_address = 0
        self._handles: dict[int, Block] = {}
        self._next_handle = 0
        self._segment_heads: list[Block] = []  # each segment's first block (its address never changes)
        self._rounded: dict[int, int] = {}  # request bytes -> round_size's answer under this config
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.segments = 0
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0

    def _pool(self, key: PoolKey) -> FreePool:
        pool = self._pools.get(key)  # not setdefault: that would build a FreePool on every call
        if pool is None:
            pool = self._pools[key] = FreePool()
        return pool

    def _unmapped_of(self, key: PoolKey) -> UnmappedRanges:
        unmapped = self._unmapped.get(key)
        if unmapped is None:
            unmapped = self._unmapped[key] = UnmappedRanges()
        return unmapped

    def malloc(self, num_bytes: int, stream: int = 0) -> int:
        # The hottest code of an allocator replay (a device fit replays a step a dozen times): pools and the
        # best fit are looked up inline, as FreePool.best_fit and FreePool.remove would.
        config = self.config
        size = self._rounded.get(num_bytes)
        if size is None:  # a replay asks for the same sizes every iteration
            size = self._rounded[num_bytes] = round_size(num_bytes, config)
        small = size <= SMALL_REQUEST_BYTES
        key = (stream, small)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = FreePool()
        free = pool.free
        block = None
        if config.expandable_segments:
            block = pool.best_fit(size, expandable=True)
        else:
            index = bisect.bisect_left(free, (size, -1))
            if index < len(free):
                block = pool.by_key[free[index]]
        max_split = config.max_split_size_bytes
        if block is not None and max_split is not None and block.size >= max_split:
            # get_free_block: no oversize block for a request below the limit, nor one more than
            # max_non_split_rounding larger than a request at or above it.
            if size < max_split or block.size >= size + config.max_non_split_rounding_bytes:
                block = None
        if block is not None:
            if config.expandable_segments:
                pool.remove(block)
            else:  # the best fit is the first block at or above the request: `index`
                del free[index]
                del pool.by_key[(block.size, block.address)]
        elif config.expandable_segments:
            block = self._expandable_block(size, key)
        else:
            block = self._new_segment(size, key)
        remaining = block.size - size
        if small or config.expandable_segments:
            split = remaining >= MIN_BLOCK_BYTES
        else:
            split = (max_split is None or size < max_split) and remaining > SMALL_REQUEST_BYTES
        if split:
            following = block.next
            rest = Block(block.address + size, remaining, small, prev=block, next=following, stream=stream)
            if following is not None:
                following.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.allocated = True
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.max_allocated_bytes:
            self.max_allocated_bytes = self.allocated_bytes
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = block
        return handle

    def malloc_or_none(self, num_bytes: int, stream: int = 0) -> int | None:
        """malloc for a request its caller can do without (a cuDNN workspace: Conv_v8.cpp's
        try_configs catches the OutOfMemoryError and runs the next plan): None where even after
        releasing the cache it does not fit."""
        try:
            return self.malloc(num_bytes, stream)
        except OutOfMemory:
            return None

    def free(self, handle: int) -> None:
        block = self._handles.pop(handle)
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = self._pool((block.stream, block.small))
        pool.add(self._merge_free_neighbours(block, pool))

    def _merge_free_neighbours(self, block: Block, pool: FreePool) -> Block:
        """try_merge_blocks with both neighbours: free ones of the same kind (mapped or not) join
        it; they leave their pool (`pool`, the block's own), the merged block is returned to be put back in it."""
        previous = block.prev
        if previous is not None and not previous.allocated and previous.mapped == block.mapped:
            self._leave(previous, block, pool)
            _join(previous, block)
            block = previous
        following = block.next
        if following is not None and not following.allocated and following.mapped == block.mapped:
            self._leave(following, block, pool)
            _join(block, following)
        return block

    def _leave(self, neighbour: Block, block: Block, pool: FreePool) -> None:
        """A free neighbour about to merge into `block` leaves their pool, or the pool's unmapped ranges."""
        if neighbour.mapped:
            pool.remove(neighbour)
        else:
            self._unmapped_of(block.pool_key).remove(neighbour)

    def _new_segment(self, request: int, key: PoolKey) -> Block:
        size = segment_size(request, self.config.large_segment_bytes)
        if not self._room_for(size):
            if not (self._release_oversize_segments(request, key) and self._room_for(size)):
                self._release_cached_segments()
                if not self._room_for(size):
                    raise OutOfMemory(f"{size:,} B more than the {self.capacity_bytes:,} B device holds")
        stream, small = key
        block = Block(self._next_address, size, small, stream=stream)
        self._segment_heads.append(block)
        self._next_address += size
        self.reserved_bytes += size
        self.segments += 1
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
        return block

    def _room_for(self, size: int) -> bool:
        return self.capacity_bytes is None or self.reserved_bytes + size <= self.capacity_bytes

    def _release_oversize_segments(self, request: int, key: PoolKey) -> bool:
        """release_available_cached_blocks(): with max_split_size_mb, cudaFree the smallest cached
        oversize segment that holds the request (at least the limit), else the largest ones, down
        to the limit, until that much is freed; whether enough was."""
        limit = self.config.max_split_size_bytes
        if limit is None:
            return False
        pool, wanted = self._pool(key), max(request, limit)
        index = bisect.bisect_left(pool.free, (wanted, -1))
        if index < len(pool.free):
            self._release(pool.by_key[pool.free[index]])
            return True
        released = 0
        for size, address in reversed(pool.free[:]):
            if released >= wanted or size < limit:
                break
            self._release(pool.by_key[(size, address)])
            released += size
        return released >= wanted

    def _release_cached_segments(self) -> None:
        """release_cached_blocks(): cudaFree every segment that is one free block; on the expandable
        path, unmap the free pages of every cached block (release_blocks), large pool first."""
        if self.config.expandable_segments:
            for key in sorted(self._pools, key=lambda key: (key[1], key[0])):  # the large pool first
                pool = self._pools[key]
                for block in [pool.by_key[free] for free in pool.free]:
                    self._unmap(block)
            return
        for head in [head for head in self._segment_heads if not head.allocated and head.next is None]:
            self._release(head)

    def _release(self, head: Block) -> None:
        """cudaFree of a cached segment that is one free block."""
        self._pool(head.pool_key).remove(head)
        self._segment_heads.remove(head)
        self.reserved_bytes -= head.size
        self.segments -= 1

    def block(self, handle: int) -> tuple[int, int]:
        """(address, size) of a live allocation; size is what memory_allocated counts for it."""
        block = self._handles[handle]
        return block.address, block.size

    def segment_layout(self) -> list[tuple[int, int, bool, list[tuple[int, int, int | None]]]]:
        """Every segment as (address, size, small, blocks), each block (address, size, live handle or
        None); an expandable segment as one entry per run of mapped memory, as torch's snapshot does."""
        handle_of = {id(block): handle for handle, block in self._handles.items()}
        result = []
        for head in self._segment_heads:
            runs: list[list[tuple[int, int, int | None]]] = [[]]
            block: Block | None = head
            while block is not None:
                if block.mapped:
                    runs[-1].append((block.address, block.size, handle_of.get(id(block))))
                elif runs[-1]:
                    runs.append([])
                block = block.next
            for blocks in runs:
                if blocks:
                    result.append((blocks[0][0], sum(size for _, size, _ in blocks), head.small, blocks))
        return result

    def reset_peak_stats(self) -> None:
        """torch.cuda.reset_peak_memory_stats(): peaks restart from the current values."""
        self.max_allocated_bytes = self.allocated_bytes
        self.max_reserved_bytes = self.reserved_bytes


def _join(block: Block, following: Block) -> None:
    """`following`, the block right after `block` in its segment, becomes part of it."""
    block.size += following.size
    block.next = following.next
    if following.next is not None:
        following.next.prev = block
