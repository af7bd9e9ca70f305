"""The blocks and pools the simulated caching allocator (memplan.estimator.cuda.allocator) keeps,
as c10/cuda/CUDACachingAllocator.cpp's Block and BlockPool hold them."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# A pool: (stream, small). Cached blocks serve only requests of their own stream and size class
# (BlockPool's ordering puts the stream first, and get_free_block stops at another stream's block).
PoolKey = tuple[int, bool]


@dataclass(eq=False)
class Block:
    """A range of one segment's addresses: allocated, cached free, or (expandable segments) unmapped."""

    address: int
    size: int
    small: bool
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None
    mapped: bool = True  # expandable segments: False for a range of addresses with no memory behind it
    stream: int = 0  # the stream it was allocated on (0: the default stream)

    @property
    def pool_key(self) -> PoolKey:
        return self.stream, self.small

    def expandable_size(self) -> int:
        """get_free_block's expandable_size: the block plus the unmapped range right after it."""
        following = self.next
        return self.size + (following.size if following is not None and not following.mapped else 0)


@dataclass
class FreePool:
    """One pool's cached free blocks, ordered by size, then address (BlockPool's set)."""

    free: list[tuple[int, int]] = field(default_factory=list)  # (size, address), sorted
    by_key: dict[tuple[int, int], Block] = field(default_factory=dict)

    def add(self, block: Block) -> None:
        key = (block.size, block.address)
        bisect.insort(self.free, key)
        self.by_key[key] = block

    def remove(self, block: Block) -> None:
        key = (block.size, block.address)
        del self.free[bisect.bisect_left(self.free, key)]
        del self.by_key[key]

    def best_fit(self, size: int, expandable: bool = False) -> Block | None:
        """The smallest free block that holds `size`, the lowest address among equals (left in the
        pool). `expandable`: get_free_block's walk on the expandable path, which moves on to the
        next block in size order while that one's expandable_size is smaller, so a block before an
        unmapped range (such as the segment's free end) is taken only when nothing else holds it."""
        index = bisect.bisect_left(self.free, (size, -1))
        if index == len(self.free):
            return None
        block = self.by_key[self.free[index]]
        if expandable:
            for following_index in range(index + 1, len(self.free)):
                following = self.by_key[self.free[following_index]]
                if following.expandable_size() >= block.expandable_size():
                    break
                block = following
        return block


@dataclass
class UnmappedRanges:
    """An expandable pool's unmapped ranges in address order (the BlockPool's `unmapped` set)."""

    addresses: list[int] = field(default_factory=list)
    by_address: dict[int, Block] = field(default_factory=dict)

    def add(self, block: Block) -> None:
        bisect.insort(self.addresses, block.address)
        self.by_address[block.address] = block

    def remove(self, block: Block) -> None:
        del self.addresses[bisect.bisect_left(self.addresses, block.address)]
        del self.by_address[block.address]

    def in_address_order(self) -> list[Block]:
        return [self.by_address[address] for address in self.addresses]
