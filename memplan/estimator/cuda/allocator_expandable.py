"""The caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), the part of
memplan.estimator.cuda.allocator's CachingAllocator that maps pages instead of making segments.

CUDACachingAllocator.cpp's expandable-segment path (`AllocatorConfig.expandable_segments`), unlike its
segments (memplan.estimator.cuda.allocator's docstring):
- gives each pool (of each stream) one segment: a range of virtual addresses mapped to memory
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

On the expandable path a failed mapping (ExpandableSegment::map, cuMemCreate short of memory)
makes release_cached_blocks unmap every page that lies wholly inside a cached free block
(release_blocks, unmap_block), wherever it is in the segment, which leaves unmapped holes. Later
requests are placed as try_allocate_expandable_block places them: find_expandable_block takes the
lowest-address unmapped range (with the free block just before it) whose run of free and unmapped
blocks holds the request, and maps pages there; get_free_block counts a free block as large as
itself plus the unmapped range after it. torch gives each segment 1.125 times the device's memory
of addresses and starts a second segment when no range has room; memplan's segment has addresses
without end, so that second segment never appears (the pages mapped, hence reserved, are the same).
"""

from __future__ import annotations

from memplan.errors import SettingsError
from memplan.estimator.cuda.alloc_conf import AllocatorConfig
from memplan.estimator.cuda.allocator_blocks import Block, FreePool, PoolKey, UnmappedRanges
from memplan.estimator.cuda.allocator_sizes import SMALL_SEGMENT_BYTES


class OutOfMemory(Exception):
    """A cudaMalloc failed even after the cached free segments were released."""


# How many addresses each pool's expandable segment has: far more than any device, so one segment
# per pool serves (torch's segments have 1.125 times the device's memory; see the module docstring).
# Segments lie one after another, each starting at a multiple of both page sizes.
_EXPANDABLE_ADDRESSES = 5 << 46


def _expandable_base(key: PoolKey) -> int:
    stream, small = key
    return (2 * stream + small) * _EXPANDABLE_ADDRESSES


class ExpandableSegments:
    """CachingAllocator's expandable path; the state and the pool operations are the allocator's own."""

    config: AllocatorConfig
    capacity_bytes: int | None
    reserved_bytes: int
    max_reserved_bytes: int
    segments: int
    _segment_heads: list[Block]

    def _pool(self, key: PoolKey) -> FreePool:
        raise NotImplementedError

    def _unmapped_of(self, key: PoolKey) -> UnmappedRanges:
        raise NotImplementedError

    def _merge_free_neighbours(self, block: Block, pool: FreePool) -> Block:
        raise NotImplementedError

    def _room_for(self, size: int) -> bool:
        raise NotImplementedError

    def _release_cached_segments(self) -> None:
        raise NotImplementedError

    def _expandable_block(self, size: int, key: PoolKey) -> Block:
        """alloc_block on the expandable path, with malloc's retry: when a page cannot be mapped,
        release_cached_blocks unmaps the cached free pages and the request is placed again.
        (release_available_cached_blocks frees only non-expandable oversize blocks: nothing here.)"""
        block = self._try_allocate_expandable(size, key)
        if block is None:
            self._release_cached_segments()
            block = self._try_allocate_expandable(size, key)
            if block is None:
                raise OutOfMemory(f"no room to map {size:,} B on a {self.capacity_bytes:,} B device")
        return block

    def _try_allocate_expandable(self, size: int, key: PoolKey) -> Block | None:
        """try_allocate_expandable_block: map pages from the range find_expandable_block chose until
        one free block there holds `size` (taken out of the pool); None when a mapping fails (the
        pages mapped before it stay mapped, as free memory)."""
        candidate = self._find_expandable(size, key)
        if not candidate.mapped:
            mapped = self._map(candidate, min(candidate.size, size))
            if mapped is None:
                return None
            candidate = mapped
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            mapped = self._map(following, min(size - candidate.size, following.size))
            if mapped is None:
                return None
            candidate = mapped
        self._pool(key).remove(candidate)
        return candidate

    def _find_expandable(self, size: int, key: PoolKey) -> Block:
        """find_expandable_block: the lowest-address unmapped range, taken from the free block just
        before it where there is one, whose run of free and unmapped blocks holds `size`."""
        for unmapped in self._unmapped_of(key).in_address_order():
            start = unmapped.prev if unmapped.prev is not None and not unmapped.prev.allocated else unmapped
            room, block = 0, start
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return start
        # The pool's first request: its segment, all addresses and no memory yet.
        stream, small = key
        if any(head.pool_key == key for head in self._segment_heads):
            # Its one segment has no room left: more than any device holds (a second one at the same base
            # would overlap it). A device of that size would have run out first.
            raise SettingsError(
                f"the step maps more than {_EXPANDABLE_ADDRESSES >> 40:,} TiB in one pool of expandable segments; "
                "give a smaller batch or sequence"
            )
        segment = Block(_expandable_base(key), _EXPANDABLE_ADDRESSES, small, mapped=False, stream=stream)
        self._unmapped_of(key).add(segment)
        self._segment_heads.append(segment)
        self.segments += 1
        return segment

    def _map(self, block: Block, size: int) -> Block | None:
        """map_block: back the front of an unmapped range with whole pages (20 MiB large, 2 MiB
        small) covering `size`, merged with free neighbours; None when the device has no room."""
        page = SMALL_SEGMENT_BYTES if block.small else self.config.large_segment_bytes
        mapped = -(-size // page) * page
        if not self._room_for(mapped):
            return None
        self._unmapped_of(block.pool_key).remove(block)
        if mapped < block.size:
            rest = Block(
                block.address + mapped,
                block.size - mapped,
                block.small,
                prev=block,
                next=block.next,
                mapped=False,
                stream=block.stream,
            )
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped
            self._unmapped_of(block.pool_key).add(rest)
        block.mapped = True
        self.reserved_bytes += mapped
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
        pool = self._pool(block.pool_key)
        merged = self._merge_free_neighbours(block, pool)
        pool.add(merged)
        return merged

    def _unmap(self, block: Block) -> None:
        """unmap_block: unmap the pages wholly inside a cached free block; what is left of the block
        before and after them stays mapped and free."""
        page = SMALL_SEGMENT_BYTES if block.small else self.config.large_segment_bytes
        base = _expandable_base(block.pool_key)
        begin = base + -(-(block.address - base) // page) * page
        end = base + (block.address + block.size - base) // page * page
        if begin >= end:
            return
        pool = self._pool(block.pool_key)
        pool.remove(block)
        if begin > block.address:
            before = Block(
                block.address, begin - block.address, block.small, prev=block.prev, next=block, stream=block.stream
            )
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.add(before)
        if end < block.address + block.size:
            after = Block(
                end, block.address + block.size - end, block.small, prev=block, next=block.next, stream=block.stream
            )
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.add(after)
        block.address, block.size, block.mapped = begin, end - begin, False
        self.reserved_bytes -= end - begin
        self._unmapped_of(block.pool_key).add(self._merge_free_neighbours(block, pool))
