"""Independent pure-Python model of PyTorch's CUDA caching allocator: the oracle of tests/test_allocator_reference.py.

Written from the C++ source of ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator`` and ``ExpandableSegment``), cross-checked against
three stored revisions of that file: an older one (torch ~2.2), the
pytorch/pytorch one (~2.5) and a recent one that has ``try_mempool_fallback``,
``AcceleratorAllocatorConfig::large_segment_size()``,
``max_non_split_rounding_size()`` and the
``should_split(block, size, is_expandable_segments_active)`` signature
(torch 2.10+ era). Where the revisions differ, this model follows the recent
one.

Scope: ONE device, ONE stream. The following simplifications are deliberate:

* no CUDA graphs / private pools / user mem pools (``captures_underway`` is
  always empty, ``try_mempool_fallback`` never finds a pool, ``get_pool``
  returns the default small or large pool);
* no events / ``stream_uses``: a freed block is immediately reusable
  (``free`` always goes straight to ``free_block``; ``process_events`` and
  ``synchronize_and_free_events`` are no-ops);
* no ``garbage_collection_threshold``, no ``set_per_process_memory_fraction``
  (``allowed_memory_maximum`` unset), no ``roundup_power2_divisions``, no
  registered ``FreeCudaMemoryCallback`` (``trigger_free_memory_callbacks``
  returns false);
* ``large_segment_size`` = kLargeBuffer (20 MiB) and
  ``max_non_split_rounding_size`` = kLargeBuffer (their defaults);
* device memory: ``capacity_bytes`` (None = unlimited). A cudaMalloc of N
  bytes fails when ``reserved + N > capacity``; an expandable map of P bytes
  of new pages fails (as a whole) when ``reserved + P > capacity``.
  "reserved" is the allocator's ``total_allocated_memory`` (same value as
  ``reserved_bytes``);
* non-expandable segments get unique, increasing, 2 MiB aligned addresses
  (never reused); each expandable segment gets a page-aligned base and an
  address space of about 2**44 bytes, so in practice one segment per pool.

Block sets keep the C++ ordering: ``pool.blocks`` is ordered by (size, ptr)
(BlockComparatorSize; the stream component is constant here) and
``pool.unmapped`` by ptr (BlockComparatorAddress). Best fit is
``lower_bound((size, 0))``, so ties go to the lower address.

Statistics follow ``torch.cuda.memory_stats()`` "all" (aggregate) names:
``allocated_bytes`` counts whole blocks (``block->size``, not the request),
``reserved_bytes`` counts cudaMalloc'd segments plus mapped expandable pages.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["OutOfMemoryError", "ReferenceAllocator"]

# Constants from CUDACachingAllocator.cpp
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1048576  # largest "small" allocation is 1 MiB
kSmallBuffer = 2097152  # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20971520  # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10485760  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2097152  # round up large allocations to 2 MiB
SIZE_MAX = (1 << 64) - 1  # default max_split_size (std::numeric_limits<size_t>::max())

# AcceleratorAllocatorConfig defaults
LARGE_SEGMENT_SIZE = kLargeBuffer  # large_segment_size_{20971520}
MAX_NON_SPLIT_ROUNDING_SIZE = kLargeBuffer  # max_non_split_rounding_size_{kLargeBuffer}

# Address layout of the model (any unique addresses would do).
_CUDA_MALLOC_BASE = 1 << 32  # first cudaMalloc address (2 MiB aligned)
_ES_ADDRESS_SPACE = 1 << 44  # virtual space reserved per expandable segment
# stride between expandable segment bases: a multiple of both page sizes
# (2 MiB and 20 MiB) and larger than the reserved address space.
_ES_STRIDE = kLargeBuffer << 20
_ES_FIRST_BASE = 64 * _ES_STRIDE


class OutOfMemoryError(Exception):
    """Raised where DeviceCachingAllocator::malloc does TORCH_CHECK_WITH(OutOfMemoryError, ...)."""


class _Block:
    """struct Block (single device, single stream)."""

    __slots__ = ("size", "ptr", "is_small", "allocated", "mapped", "prev", "next", "seg", "requested_size")

    def __init__(self, size: int, ptr: int, is_small: bool):
        self.size = size
        self.ptr = ptr
        self.is_small = is_small  # block->pool->is_small
        self.allocated = False
        self.mapped = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.seg: _ExpandableSegment | None = None  # expandable_segment_
        self.requested_size = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        """Block::splice: insert self between before and after."""
        if before is not None:
            assert before.next is after
            before.next = self
        self.prev = before
        if after is not None:
            assert after.prev is before
            after.prev = self
        self.next = after

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        state = "alloc" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"<Block {self.ptr:#x}+{self.size} {state}>"


class _SortedBlockSet:
    """std::set<Block*, Comparison> with a fixed key per element.

    As in the C++ code, a block's size/ptr are never modified while it is a
    member (callers erase, modify, re-insert)."""

    def __init__(self, keyfn):
        self._keyfn = keyfn
        self._keys: list = []
        self._items: list[_Block] = []

    def insert(self, b: _Block) -> None:
        k = self._keyfn(b)
        i = bisect_left(self._keys, k)
        assert i == len(self._keys) or self._keys[i] != k, "duplicate key in block set"
        self._keys.insert(i, k)
        self._items.insert(i, b)

    def erase(self, b: _Block) -> int:
        k = self._keyfn(b)
        i = bisect_left(self._keys, k)
        if i < len(self._keys) and self._keys[i] == k and self._items[i] is b:
            del self._keys[i]
            del self._items[i]
            return 1
        return 0

    def lower_bound(self, key) -> int:
        return bisect_left(self._keys, key)

    def contains(self, b: _Block) -> bool:
        k = self._keyfn(b)
        i = bisect_left(self._keys, k)
        return i < len(self._keys) and self._items[i] is b

    def __getitem__(self, i: int) -> _Block:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def snapshot(self) -> list[_Block]:
        return list(self._items)


class _BlockPool:
    """struct BlockPool: free mapped blocks by (size, ptr), unmapped by ptr."""

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.blocks = _SortedBlockSet(lambda b: (b.size, b.ptr))
        self.unmapped = _SortedBlockSet(lambda b: b.ptr)


class _ExpandableSegment:
    """struct ExpandableSegment: a reserved VA range of max_handles pages of
    segment_size bytes (kSmallBuffer for the small pool, large_segment_size
    for the large pool); handles[i] is True when page i is mapped."""

    def __init__(self, base: int, segment_size: int, is_small: bool):
        assert base % segment_size == 0
        self.base = base
        self.segment_size = segment_size
        self.is_small = is_small
        self.max_handles = -(-_ES_ADDRESS_SPACE // segment_size)
        self.handles: list[bool] = []

    def size(self) -> int:
        return self.max_handles * self.segment_size

    def _num_segments(self, size: int) -> int:
        return -(-size // self.segment_size)

    def _segment_left(self, p: int) -> int:
        return (p - self.base) // self.segment_size

    def _segment_right(self, p: int) -> int:
        return self._num_segments(p - self.base)

    def _trim(self) -> None:
        while self.handles and not self.handles[-1]:
            self.handles.pop()

    def map(self, ptr: int, size: int, can_alloc) -> tuple[int, int]:
        """ExpandableSegment::map: map every page touching [ptr, ptr+size).
        Returns (ptr, mapped_size); size 0 means OOM (all or nothing)."""
        begin = self._segment_left(ptr)
        end = self._segment_right(ptr + size)
        assert self.base + begin * self.segment_size == ptr
        if begin == end:
            return ptr, 0
        nbytes = (end - begin) * self.segment_size
        if not can_alloc(nbytes):
            # cuMemCreate failed part way: pages created so far are released.
            return self.base + begin * self.segment_size, 0
        while end > len(self.handles):
            self.handles.append(False)
        for i in range(begin, end):
            assert not self.handles[i], "mapping an already mapped page"
            self.handles[i] = True
        return self.base + begin * self.segment_size, nbytes

    def unmap(self, ptr: int, size: int) -> tuple[int, int]:
        """ExpandableSegment::unmap: unmap only pages wholly inside the range."""
        begin = self._segment_right(ptr)
        end = self._segment_left(ptr + size)
        if begin >= end:
            return ptr, 0
        for i in range(begin, end):
            assert self.handles[i], "unmapping a page that is not mapped"
            self.handles[i] = False
        self._trim()
        return self.base + begin * self.segment_size, (end - begin) * self.segment_size

    def mapped_bytes(self) -> int:
        return sum(self.handles) * self.segment_size


def _round_size(size: int) -> int:
    """DeviceCachingAllocator::round_size with roundup_power2_divisions unset."""
    if size < kMinBlockSize:
        return kMinBlockSize
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


def _get_allocation_size(size: int) -> int:
    """DeviceCachingAllocator::get_allocation_size."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return LARGE_SEGMENT_SIZE
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


class ReferenceAllocator:
    """Model of DeviceCachingAllocator for one device and one stream.

    Method -> C++ function followed:

    * ``malloc``  -> DeviceCachingAllocator::malloc (round_size, get_pool,
      get_allocation_size, get_free_block, then
      ``alloc_block(false) || (release_available_cached_blocks && alloc_block(false))
      || (release_cached_blocks && alloc_block(true))``, OOM, should_split,
      alloc_found_block);
    * ``free``    -> DeviceCachingAllocator::free -> free_block ->
      try_merge_blocks (no stream_uses, so never insert_events);
    * ``empty_cache`` -> emptyCache -> release_cached_blocks ->
      release_blocks (release_block / unmap_block /
      release_expandable_segment);
    * expandable segments: alloc_block -> try_allocate_expandable_block ->
      find_expandable_block, map_block -> ExpandableSegment::map;
      unmap_block -> ExpandableSegment::unmap.
    """

    def __init__(
        self,
        expandable_segments: bool = False,
        capacity_bytes: int | None = None,
        max_split_size_bytes: int | None = None,
    ):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0 or None")
        if max_split_size_bytes is not None and max_split_size_bytes <= kLargeBuffer:
            # CUDAAllocatorConfig::parseMaxSplitSize rejects max_split_size_mb <= 20;
            # smaller values could make release_block cudaFree a split block.
            raise ValueError("max_split_size_bytes must be > 20 MiB (torch rejects smaller)")
        self.expandable_segments = bool(expandable_segments)
        self.capacity_bytes = capacity_bytes
        self.max_split_size = SIZE_MAX if max_split_size_bytes is None else int(max_split_size_bytes)

        self._small = _BlockPool(is_small=True)
        self._large = _BlockPool(is_small=False)
        self._active: dict[int, _Block] = {}  # handle -> allocated block
        self._next_handle = 1
        self._next_cuda_addr = _CUDA_MALLOC_BASE
        self._next_es_base = _ES_FIRST_BASE
        self._cuda_segments: dict[int, tuple[int, bool]] = {}  # base -> (size, is_small)
        self._expandable: list[_ExpandableSegment] = []  # expandable_segments_

        # torch.cuda.memory_stats() "…all.current" / "…all.peak"
        self.allocated_bytes = 0
        self.max_allocated_bytes = 0
        self.reserved_bytes = 0
        self.max_reserved_bytes = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    # ------------------------------------------------------------------ API
    def malloc(self, nbytes: int) -> int:
        """DeviceCachingAllocator::malloc. Returns an opaque handle.

        Note: torch's NativeCachingAllocator::allocate never calls malloc for
        0 bytes (it returns a null DataPtr); here malloc(0) behaves like
        DeviceCachingAllocator::malloc(0), i.e. a 512 byte block."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        size = _round_size(nbytes)
        pool = self._get_pool(size)
        alloc_size = _get_allocation_size(size)

        # First, try to get a block from the existing pool.
        # (trigger_free_memory_callbacks: no callbacks -> false)
        block = self._get_free_block(pool, size)

        if block is None:
            # alloc_block(params, false)
            block = self._alloc_block(pool, size, alloc_size, is_retry=False)
            # || (try_mempool_fallback: no pools -> false)
            # || (release_available_cached_blocks && alloc_block(params, false))
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size, is_retry=False)
            # || (captures_underway.empty() && release_cached_blocks && alloc_block(params, true))
            if block is None and self._release_cached_blocks():
                block = self._alloc_block(pool, size, alloc_size, is_retry=True)

        if block is None:
            self.num_ooms += 1
            raise OutOfMemoryError(
                f"CUDA out of memory (model). Tried to allocate {alloc_size} bytes "
                f"(request {nbytes}, rounded {size}); capacity {self.capacity_bytes}, "
                f"reserved {self.reserved_bytes}, allocated {self.allocated_bytes}"
            )

        split_remainder = self._should_split(block, size)
        block = self._alloc_found_block(block, pool, size, nbytes, split_remainder)
        handle = self._next_handle
        self._next_handle += 1
        self._active[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free (stream_uses always empty -> free_block)."""
        try:
            block = self._active.pop(handle)
        except KeyError:
            raise ValueError(f"invalid handle {handle!r}") from None
        block.allocated = False
        self.allocated_bytes -= block.size
        self._free_block(block)

    def address(self, handle: int) -> int:
        """block->ptr of an allocated handle."""
        return self._active[handle].ptr

    def block_size(self, handle: int) -> int:
        """block->size of an allocated handle (what allocated_bytes counts)."""
        return self._active[handle].size

    def empty_cache(self) -> None:
        """DeviceCachingAllocator::emptyCache -> release_cached_blocks."""
        self._release_cached_blocks()

    def memory_stats(self) -> dict:
        return {
            "allocated_bytes.all.current": self.allocated_bytes,
            "allocated_bytes.all.peak": self.max_allocated_bytes,
            "reserved_bytes.all.current": self.reserved_bytes,
            "reserved_bytes.all.peak": self.max_reserved_bytes,
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
        }

    def snapshot(self) -> list[dict]:
        """Segments (expandable: the whole VA range) with their blocks, by address."""
        out = []
        for head in self._segment_heads():
            blocks = []
            b = head
            while b is not None:
                blocks.append({"ptr": b.ptr, "size": b.size, "allocated": b.allocated, "mapped": b.mapped})
                b = b.next
            out.append(
                {
                    "address": head.ptr,
                    "is_small": head.is_small,
                    "is_expandable": head.seg is not None,
                    "blocks": blocks,
                }
            )
        out.sort(key=lambda s: s["address"])
        return out

    # ------------------------------------------------------------- helpers
    def _get_pool(self, size: int) -> _BlockPool:
        """get_pool (no captures): small pool for size <= kSmallSize."""
        return self._small if size <= kSmallSize else self._large

    def _pool_of(self, block: _Block) -> _BlockPool:
        return self._small if block.is_small else self._large

    def _device_can_alloc(self, nbytes: int) -> bool:
        return self.capacity_bytes is None or self.reserved_bytes + nbytes <= self.capacity_bytes

    def _increase_reserved(self, n: int) -> None:
        self.reserved_bytes += n
        if self.reserved_bytes > self.max_reserved_bytes:
            self.max_reserved_bytes = self.reserved_bytes

    def _should_split(self, block: _Block, size: int) -> bool:
        """should_split(block, size, is_expandable_segments_active)."""
        remaining = block.size - size
        if block.is_small or self.expandable_segments:
            return remaining >= kMinBlockSize
        return size < self.max_split_size and remaining > kSmallSize

    def _get_free_block(self, pool: _BlockPool, size: int) -> _Block | None:
        """get_free_block: best fit by lower_bound, expandable_size walk,
        max_split_size rules."""
        blocks = pool.blocks
        i = blocks.lower_bound((size, 0))
        if i == len(blocks):
            return None
        if blocks[i].seg is not None:
            if self.expandable_segments:
                # For best fit, an expandable block counts with the unmapped
                # space right after it.
                def expandable_size(b: _Block) -> int:
                    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

                j = i + 1
                while (
                    blocks[i].seg is not None
                    and j < len(blocks)
                    and expandable_size(blocks[j]) < expandable_size(blocks[i])
                ):
                    i = j
                    j += 1
            else:  # pragma: no cover - expandable setting is fixed per allocator here
                i += 1
                while i < len(blocks) and blocks[i].seg is not None:
                    i += 1
                if i == len(blocks):
                    return None
        b = blocks[i]
        # Do not return an oversized block for a large request
        if size < self.max_split_size and b.size >= self.max_split_size:
            return None
        # Allow oversized block size to be rounded up but within a limit
        if size >= self.max_split_size and b.size >= size + MAX_NON_SPLIT_ROUNDING_SIZE:
            return None
        blocks.erase(b)
        return b

    def _alloc_block(self, pool: _BlockPool, size: int, alloc_size: int, is_retry: bool) -> _Block | None:
        """alloc_block: expandable -> try_allocate_expandable_block(p.size());
        otherwise cudaMalloc(p.alloc_size) or failure."""
        if is_retry:
            self.num_alloc_retries += 1
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        if not self._device_can_alloc(alloc_size):
            return None  # cudaErrorMemoryAllocation
        ptr = self._next_cuda_addr
        self._next_cuda_addr += -(-alloc_size // kRoundLarge) * kRoundLarge
        self._cuda_segments[ptr] = (alloc_size, pool.is_small)
        self._increase_reserved(alloc_size)
        self.num_device_alloc += 1
        return _Block(alloc_size, ptr, pool.is_small)

    def _alloc_found_block(
        self, block: _Block, pool: _BlockPool, size: int, orig_size: int, split_remainder: bool
    ) -> _Block:
        """alloc_found_block: the allocation takes the front of the block."""
        if split_remainder:
            remaining = block
            block = _Block(size, remaining.ptr, pool.is_small)
            block.seg = remaining.seg
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            pool.blocks.insert(remaining)
        block.allocated = True
        block.requested_size = orig_size
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.max_allocated_bytes:
            self.max_allocated_bytes = self.allocated_bytes
        return block

    def _free_block(self, block: _Block) -> None:
        """free_block: merge with free neighbours, return to pool.blocks."""
        pool = self._pool_of(block)
        for cand in (block.prev, block.next):
            self._try_merge_blocks(block, cand, pool)
        pool.blocks.insert(block)

    def _try_merge_blocks(self, dst: _Block, src: _Block | None, pool: _BlockPool) -> int:
        """try_merge_blocks: src must be free and have the same mapped state."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        assert dst.is_split() and src.is_split()
        if dst.prev is src:  # [src dst]
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            assert dst.next is src
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        subsumed = src.size
        dst.size += subsumed
        erased = pool.blocks.erase(src) if src.mapped else pool.unmapped.erase(src)
        assert erased == 1
        return subsumed

    def _release_available_cached_blocks(self, pool: _BlockPool, size: int) -> bool:
        """release_available_cached_blocks (recent version: skips expandable blocks)."""
        mss = self.max_split_size
        if mss == SIZE_MAX:
            return False
        key_size = mss if size < mss else size
        blocks = pool.blocks
        i = blocks.lower_bound((key_size, 0))
        if i == len(blocks) or blocks[i].seg is not None:
            # No single block is large enough; free multiple oversize blocks,
            # starting with the largest
            if i == 0:
                return False
            total_released = 0
            i -= 1
            while total_released < key_size and blocks[i].size >= mss:
                cur = blocks[i]
                is_first = i == 0
                if not is_first:
                    i -= 1
                if cur.seg is None:
                    total_released += cur.size
                    self._release_block(cur)
                if is_first:
                    break
            if total_released < key_size:
                return False
        else:
            self._release_block(blocks[i])
        return True

    def _release_cached_blocks(self) -> bool:
        """release_cached_blocks(context, {0,0}): no events to synchronize."""
        self._release_blocks(self._large)
        self._release_blocks(self._small)
        return True

    def _release_blocks(self, pool: _BlockPool) -> None:
        """release_blocks: cudaFree every unsplit free block; unmap the free
        pages of expandable blocks; drop fully unmapped expandable segments."""
        to_unmap = []
        for block in pool.blocks.snapshot():
            if block.seg is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if block.prev is None and block.next is None:
                self._release_expandable_segment(block)

    def _release_block(self, block: _Block) -> None:
        """release_block: cudaFree of a whole (unsplit) segment."""
        assert block.seg is None
        assert not block.is_split(), "release_block on a split block (cudaFree of a non-base pointer)"
        pool = self._pool_of(block)
        erased = pool.blocks.erase(block)
        assert erased == 1
        seg_size, _ = self._cuda_segments.pop(block.ptr)
        assert seg_size == block.size
        self.reserved_bytes -= block.size
        self.num_device_free += 1

    def _release_expandable_segment(self, block: _Block) -> None:
        """release_expandable_segment."""
        es = block.seg
        assert es is not None and block.size == es.size() and not block.mapped
        self._expandable.remove(es)
        erased = self._pool_of(block).unmapped.erase(block)
        assert erased == 1
        assert not any(es.handles)

    def _unmap_block(self, block: _Block) -> None:
        """unmap_block: unmap the pages wholly inside a free expandable block;
        partial pages at either end stay as free mapped blocks."""
        es = block.seg
        pool = self._pool_of(block)
        uptr, usize = es.unmap(block.ptr, block.size)
        if usize == 0:
            return
        erased = pool.blocks.erase(block)
        assert erased == 1

        before_size = uptr - block.ptr
        if before_size > 0:
            before_free = _Block(before_size, block.ptr, block.is_small)
            before_free.seg = es
            before_free.splice(block.prev, block)
            pool.blocks.insert(before_free)

        after_size = block.size - (before_size + usize)
        if after_size > 0:
            after_free = _Block(after_size, uptr + usize, block.is_small)
            after_free.seg = es
            after_free.splice(block, block.next)
            pool.blocks.insert(after_free)

        block.ptr = uptr
        block.size = usize
        block.mapped = False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.unmapped.insert(block)

        self.reserved_bytes -= usize
        self.num_device_free += 1

    # ---------------------------------------------------- expandable segments
    def _find_expandable_block(self, pool: _BlockPool, size: int) -> _Block:
        """find_expandable_block: lowest address where free + unmapped space
        (starting at an unmapped block, or the free block just before it) can
        hold size; else a new segment."""

        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        def has_available_address_space(b: _Block | None) -> bool:
            nbytes = 0
            while nbytes < size and allocatable(b):
                nbytes += b.size
                b = b.next
            return nbytes >= size

        for c in pool.unmapped.snapshot():
            if allocatable(c.prev):
                c = c.prev
            if has_available_address_space(c):
                return c

        segment_size = kSmallBuffer if pool.is_small else LARGE_SEGMENT_SIZE
        es = _ExpandableSegment(self._next_es_base, segment_size, pool.is_small)
        self._next_es_base += _ES_STRIDE
        self._expandable.append(es)
        candidate = _Block(es.size(), es.base, pool.is_small)
        candidate.mapped = False
        candidate.seg = es
        pool.unmapped.insert(candidate)
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """map_block: map the pages covering [to_map.ptr, +size), keep the
        rest unmapped, merge with free mapped neighbours."""
        assert not to_map.mapped and size <= to_map.size
        es = to_map.seg
        mptr, msize = es.map(to_map.ptr, size, self._device_can_alloc)
        if msize == 0:
            return False
        assert mptr == to_map.ptr and msize >= size
        pool = self._pool_of(to_map)
        erased = pool.unmapped.erase(to_map)
        assert erased == 1
        to_map.mapped = True

        if msize < to_map.size:
            remaining = _Block(to_map.size - msize, to_map.ptr + msize, to_map.is_small)
            remaining.mapped = False
            remaining.seg = es
            remaining.splice(to_map, to_map.next)
            pool.unmapped.insert(remaining)
            to_map.size = msize

        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.blocks.insert(to_map)

        self._increase_reserved(msize)
        self.num_device_alloc += 1
        return True

    def _try_allocate_expandable_block(self, pool: _BlockPool, size: int) -> _Block | None:
        """try_allocate_expandable_block."""
        candidate = self._find_expandable_block(pool, size)
        # candidate: unmapped -> null | unmapped -> free -> * | free -> unmapped -> *
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        assert candidate.mapped
        while candidate.size < size:
            remaining = size - candidate.size
            new_candidate = candidate.next
            assert new_candidate is not None and not new_candidate.mapped
            if not self._map_block(new_candidate, min(remaining, new_candidate.size)):
                return None
            candidate = new_candidate
        erased = pool.blocks.erase(candidate)
        assert erased == 1
        return candidate

    # ------------------------------------------------------------ checking
    def _all_blocks(self) -> list[_Block]:
        out = []
        for pool in (self._small, self._large):
            out.extend(pool.blocks.snapshot())
            out.extend(pool.unmapped.snapshot())
        out.extend(self._active.values())
        return out

    def _segment_heads(self) -> list[_Block]:
        return [b for b in self._all_blocks() if b.prev is None]

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent."""
        blocks = self._all_blocks()
        ids = {id(b) for b in blocks}
        assert len(ids) == len(blocks), "a block is in more than one container"
        active = {id(b) for b in self._active.values()}
        for pool in (self._small, self._large):
            for b in pool.blocks.snapshot():
                assert b.mapped and not b.allocated and b.is_small == pool.is_small
            for b in pool.unmapped.snapshot():
                assert not b.mapped and not b.allocated and b.seg is not None
                assert b.is_small == pool.is_small
        for b in self._active.values():
            assert b.allocated and b.mapped
        for b in blocks:
            assert b.size > 0 and b.size % kMinBlockSize == 0 and b.ptr % kMinBlockSize == 0
            assert (id(b) in active) == b.allocated
            for n in (b.prev, b.next):
                assert n is None or id(n) in ids, "dangling neighbour"
            if b.next is not None:
                assert b.next.prev is b and b.ptr + b.size == b.next.ptr, "blocks not contiguous"
                assert b.next.is_small == b.is_small and b.next.seg is b.seg
                if not b.allocated and not b.next.allocated:
                    assert b.mapped != b.next.mapped, "adjacent free blocks not merged"
            if b.prev is not None:
                assert b.prev.next is b

        ranges = []
        heads = self._segment_heads()
        seen = 0
        cuda_reserved = 0
        es_by_id = {id(es): es for es in self._expandable}
        es_heads = set()
        for h in heads:
            total = 0
            mapped_total = 0
            b = h
            while b is not None:
                seen += 1
                total += b.size
                if b.mapped:
                    mapped_total += b.size
                if b.seg is not None:
                    es = b.seg
                    pg = es.segment_size
                    if not b.mapped:
                        assert (b.ptr - es.base) % pg == 0 and b.size % pg == 0
                    first = (b.ptr - es.base) // pg
                    last = (b.ptr + b.size - 1 - es.base) // pg
                    for p in (first, last):
                        on = p < len(es.handles) and es.handles[p]
                        assert on == b.mapped, "page mapping disagrees with block"
                b = b.next
            if h.seg is None:
                assert self._cuda_segments.get(h.ptr, (None,))[0] == total, "segment size mismatch"
                assert h.is_small == self._cuda_segments[h.ptr][1]
                cuda_reserved += total
            else:
                es = h.seg
                assert id(es) in es_by_id and h.ptr == es.base and total == es.size()
                assert mapped_total == es.mapped_bytes()
                es_heads.add(id(es))
            ranges.append((h.ptr, h.ptr + total))
        assert seen == len(blocks), "blocks not reachable from a segment head"
        assert len(heads) == len(self._cuda_segments) + len(self._expandable)
        assert es_heads == set(es_by_id)
        ranges.sort()
        for (_s0, e0), (s1, _e1) in zip(ranges, ranges[1:], strict=False):
            assert e0 <= s1, "segments overlap"
        es_reserved = sum(es.mapped_bytes() for es in self._expandable)
        assert self.reserved_bytes == cuda_reserved + es_reserved, "reserved_bytes mismatch"
        assert self.allocated_bytes == sum(b.size for b in self._active.values())
        assert 0 <= self.allocated_bytes <= self.reserved_bytes
        assert self.max_allocated_bytes >= self.allocated_bytes
        assert self.max_reserved_bytes >= self.reserved_bytes
        if self.capacity_bytes is not None:
            assert self.max_reserved_bytes <= self.capacity_bytes
        if not self.expandable_segments:
            assert not self._expandable
        else:
            assert not self._cuda_segments
            assert sum(1 for es in self._expandable if es.is_small) <= 1
            assert sum(1 for es in self._expandable if not es.is_small) <= 1
