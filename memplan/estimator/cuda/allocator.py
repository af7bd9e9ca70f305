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

With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (`AllocatorConfig`), the same file's
expandable-segment path instead:
- gives each pool (of the one stream) one segment: a range of virtual addresses mapped to memory
  in pages of kLargeBuffer = 20 MiB (large pool) or kSmallBuffer = 2 MiB (small pool), from the
  start, as requests need them (find_expandable_block, map_block);
- takes the best-fitting free block as before, except that the free block at the end of the
  mapped range counts as large as it could grow (get_free_block's `expandable_size`), so it is
  chosen only when no other free block holds the request;
- otherwise grows the segment: the free block at its end (if any) plus as many new pages as the
  request still needs (try_allocate_expandable_block), reserved growing by those pages;
- splits any block whose remainder is at least 512 bytes, in both pools (should_split);
- maps nothing out within a step, as pages are released only when a mapping fails or on
  empty_cache().

On a device of limited memory (`capacity_bytes`), the default allocator's answer to a failed
cudaMalloc is simulated too (DeviceCachingAllocator::malloc): release_available_cached_blocks
does nothing without max_split_size_mb, so release_cached_blocks frees every cached segment
that is wholly free, and the cudaMalloc is tried once more; if that fails too, the step runs out
of memory (OutOfMemory). The expandable path's answer (unmapping free pages anywhere in the
segment) is not simulated.
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
# Keys CUDAAllocatorConfig::parseArgs accepts (c10/cuda/CUDAAllocatorConfig.cpp, torch 2.11-2.14);
# memplan models expandable_segments and notes the others it does not.
ALLOC_CONF_KEYS = frozenset(
    {
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "backend",
        "graph_capture_record_stream_reuse",
        "per_process_memory_fraction",
    }
)


@dataclass(frozen=True)
class AllocatorConfig:
    """PYTORCH_CUDA_ALLOC_CONF as far as memplan models it."""

    expandable_segments: bool = False


DEFAULT_CONFIG = AllocatorConfig()  # no PYTORCH_CUDA_ALLOC_CONF


def _split_options(text: str) -> list[str]:
    """`key:value` items separated by commas outside brackets (roundup_power2_divisions takes lists)."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def parse_alloc_conf(text: str) -> tuple[AllocatorConfig, tuple[str, ...]]:
    """(what memplan models, the keys given that it does not) from a PYTORCH_CUDA_ALLOC_CONF value.

    Raises ValueError, with the reason, where torch's own parser would refuse the value.
    """
    expandable = False
    unmodelled = []
    for item in _split_options(text):
        key, separator, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not separator or not value:
            raise ValueError(f"{item!r} is not key:value")
        if key not in ALLOC_CONF_KEYS:
            raise ValueError(f"unknown option {key!r}; torch knows {', '.join(sorted(ALLOC_CONF_KEYS))}")
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"expandable_segments takes True or False, got {value!r}")
            expandable = value == "True"
        else:
            unmodelled.append(key)
    return AllocatorConfig(expandable_segments=expandable), tuple(unmodelled)


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

    def best_fit(self, size: int, last: _Block | None = None) -> _Block | None:
        """The smallest free block that holds `size`, the lowest address among equals. `last`: an
        expandable segment's end block, which counts as large as it could grow (taken only alone)."""
        index = bisect.bisect_left(self.free, (size, -1))
        if index == len(self.free):
            return None
        block = self.by_key[self.free[index]]
        if block is last and index + 1 < len(self.free):
            block = self.by_key[self.free[index + 1]]
        self.remove(block)
        return block


class OutOfMemory(Exception):
    """A cudaMalloc failed even after the cached free segments were released."""


# Where each pool's expandable segment starts: far apart, so addresses never meet.
_EXPANDABLE_BASE = {True: 0, False: 1 << 50}


class CachingAllocator:
    """One device, one stream. `malloc` returns a handle for `free`; statistics as torch.cuda names them."""

    def __init__(self, config: AllocatorConfig = DEFAULT_CONFIG, capacity_bytes: int | None = None) -> None:
        self.config = config
        self.capacity_bytes = capacity_bytes  # None: as much memory as the step asks for
        self._last: dict[bool, _Block | None] = {True: None, False: None}  # expandable: each pool's end block
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
        if self.config.expandable_segments:
            block = pool.best_fit(size, last=self._last[small]) or self._grow(size, small)
        else:
            block = pool.best_fit(size) or self._new_segment(segment_size(size), small)
        remaining = block.size - size
        expandable_split = self.config.expandable_segments and remaining >= MIN_BLOCK_BYTES
        if expandable_split or (remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_BYTES):
            rest = _Block(block.address + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            elif self.config.expandable_segments:
                self._last[small] = rest
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
        if self.config.expandable_segments and block.next is None:
            self._last[block.small] = block
        pool.add(block)

    def _grow(self, size: int, small: bool) -> _Block:
        """Map pages at the end of the pool's expandable segment until its end block holds `size`."""
        page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
        last = self._last[small]
        if last is not None and not last.allocated:
            self._pools[small].remove(last)
            block, needed = last, size - last.size
        else:
            block, needed = None, size
        mapped = -(-needed // page) * page
        if block is None:
            mapped_end = last.address + last.size if last is not None else _EXPANDABLE_BASE[small]
            block = _Block(mapped_end, 0, small, prev=last)
            if last is None:
                self._segment_heads.append(block)
                self.segments += 1
            else:
                last.next = block
            self._last[small] = block
        block.size += mapped
        self.reserved_bytes += mapped
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
        return block

    def _new_segment(self, size: int, small: bool) -> _Block:
        if self.capacity_bytes is not None and self.reserved_bytes + size > self.capacity_bytes:
            self._release_cached_segments()
            if self.reserved_bytes + size > self.capacity_bytes:
                raise OutOfMemory(f"{size:,} B more than the {self.capacity_bytes:,} B device holds")
        block = _Block(self._next_address, size, small)
        self._segment_heads.append(block)
        self._next_address += size
        self.reserved_bytes += size
        self.segments += 1
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
        return block

    def _release_cached_segments(self) -> None:
        """release_cached_blocks(): cudaFree every segment that is one free block."""
        kept = []
        for head in self._segment_heads:
            if head.allocated or head.next is not None:
                kept.append(head)
                continue
            self._pools[head.small].remove(head)
            self.reserved_bytes -= head.size
            self.segments -= 1
        self._segment_heads = kept

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
