"""The caching-allocator simulator on hand-written allocation traces, with hand-computed segments."""

import pytest

from memplan.estimator.cuda.allocator import CachingAllocator, round_size, segment_size

KiB, MiB = 1 << 10, 1 << 20


def test_round_size_and_segment_sizes_follow_the_allocator_constants() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513)] == [512, 512, 512, 1024]
    assert segment_size(512) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(1 * MiB) == 2 * MiB  # 1 MiB is still small
    assert segment_size(1 * MiB + 512) == 20 * MiB  # large, under 10 MiB: a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB  # 10 MiB and up: rounded to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_requests_share_one_2mib_segment() -> None:
    allocator = CachingAllocator()
    handles = [allocator.malloc(100 * KiB) for _ in range(20)]  # 20 x 100 KiB = 2000 KiB <= 2048 KiB
    assert allocator.segments == 1
    assert allocator.reserved_bytes == 2 * MiB
    assert allocator.allocated_bytes == 20 * 100 * KiB
    allocator.malloc(100 * KiB)  # 48 KiB left in the segment: a second one
    assert allocator.segments == 2
    for handle in handles:
        allocator.free(handle)
    assert allocator.allocated_bytes == 100 * KiB
    assert allocator.max_reserved_bytes == 4 * MiB


def test_large_requests_below_10mib_carve_20mib_segments() -> None:
    allocator = CachingAllocator()
    first = allocator.malloc(6 * MiB)
    second = allocator.malloc(6 * MiB)
    third = allocator.malloc(6 * MiB)  # 18 MiB of one 20 MiB segment
    assert allocator.segments == 1
    fourth = allocator.malloc(6 * MiB)  # 2 MiB left: a new segment
    assert (allocator.segments, allocator.reserved_bytes) == (2, 40 * MiB)
    for handle in (first, second, third, fourth):
        allocator.free(handle)
    # Freed neighbours merge: 20 MiB fits again in the first segment's one free block.
    allocator.malloc(20 * MiB)
    assert allocator.segments == 2


def test_an_unsplit_block_is_counted_whole() -> None:
    allocator = CachingAllocator()
    big = allocator.malloc(12 * MiB)  # a 12 MiB segment
    allocator.free(big)
    # 11.5 MiB leaves 0.5 MiB, not more than 1 MiB: the large pool does not split, so the whole
    # 12 MiB block is handed out and memory_allocated counts 12 MiB.
    allocator.malloc(11 * MiB + 512 * KiB)
    assert allocator.allocated_bytes == 12 * MiB
    assert allocator.segments == 1


def test_best_fit_takes_the_smallest_block_that_holds_the_request() -> None:
    allocator = CachingAllocator()
    a = allocator.malloc(30 * MiB)
    b = allocator.malloc(14 * MiB)
    allocator.free(a)
    allocator.free(b)  # free blocks: 30 MiB and 14 MiB, separate segments
    allocator.malloc(12 * MiB)  # best fit: the 14 MiB block, split 12 + 2 (2 MiB > 1 MiB)
    allocator.malloc(28 * MiB)  # the 30 MiB block, split 28 + 2
    assert allocator.segments == 2
    assert allocator.allocated_bytes == 40 * MiB
    allocator.malloc(2 * MiB)  # one of the two 2 MiB remainders
    assert allocator.segments == 2


def test_fragmentation_forces_a_new_segment_and_peaks_reset() -> None:
    allocator = CachingAllocator()
    blocks = [allocator.malloc(4 * MiB) for _ in range(5)]  # one 20 MiB segment, full
    for handle in blocks[::2]:
        allocator.free(handle)  # three free 4 MiB holes, none adjacent
    allocator.reset_peak_stats()
    assert allocator.max_allocated_bytes == 8 * MiB
    allocator.malloc(8 * MiB)  # no hole holds 8 MiB: a second 20 MiB segment
    assert (allocator.segments, allocator.max_reserved_bytes, allocator.max_allocated_bytes) == (2, 40 * MiB, 16 * MiB)


def test_optimizer_state_is_first_allocated_inside_the_first_step() -> None:
    from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation, replay_steady_state

    # Forward and backward at nodes 0-1 hold a 30 MiB temporary; the optimizer step starts at
    # node 2 with 20 MiB of state that then lives on. A real first step finds the 30 MiB segment
    # free and carves the state out of it, so every later forward needs a segment of its own:
    # 30 + 30 MiB. Allocating the state before everything (20 MiB, then 30 MiB) would say 50 MiB.
    timeline = MemoryTimeline(
        node_count=3,
        forward_end=1,
        backward_end=2,
        allocations=(
            TimelineAllocation(0, 3, 20 * MiB, "optimizer_state", "get_attr", None),
            TimelineAllocation(0, 1, 30 * MiB, "activations", "aten.mm", None),
        ),
    )
    allocator = CachingAllocator()
    replay_steady_state(timeline, allocator)
    assert allocator.max_reserved_bytes == 60 * MiB
    assert allocator.segments == 2


def test_a_cublas_workspace_is_made_at_its_threads_first_matmul_in_the_first_iteration() -> None:
    from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation, replay_steady_state

    # The forward makes and frees a 30 MiB temporary at node 0; the backward's first matmul is node
    # 1, where its thread's 12 MiB cuBLAS workspace is made; node 2 holds 30 MiB again until node 3.
    def timeline(workspace_made_at: int | None) -> MemoryTimeline:
        return MemoryTimeline(
            node_count=4,
            forward_end=1,
            backward_end=3,
            allocations=(
                TimelineAllocation(
                    0, 4, 12 * MiB, "workspaces", "cublas workspace", None, first_used_at=workspace_made_at
                ),
                TimelineAllocation(0, 0, 30 * MiB, "temporaries", "aten.mm", None),
                TimelineAllocation(2, 3, 30 * MiB, "temporaries", "aten.mm", None),
            ),
        )

    # Made at node 1 of the first iteration: the forward's 30 MiB block is cached and free, best fit
    # carves the workspace out of it (12 + 18 MiB), and node 2 finds no 30 MiB block: a second 30 MiB
    # segment, which every later iteration's two temporaries share. 30 + 30 MiB.
    lazily = CachingAllocator()
    replay_steady_state(timeline(1), lazily)
    assert (lazily.max_reserved_bytes, lazily.segments) == (60 * MiB, 2)
    # Allocated before everything: a 12 MiB segment of its own, and one 30 MiB segment serves both
    # temporaries. 12 + 30 MiB.
    upfront = CachingAllocator()
    replay_steady_state(timeline(None), upfront)
    assert (upfront.max_reserved_bytes, upfront.segments) == (42 * MiB, 2)


def test_max_memory_allocated_counts_a_cached_block_handed_out_whole() -> None:
    from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation, allocator_peak_bytes

    # A 12 MiB temporary (its own 12 MiB segment) freed at node 0; node 1 asks for 11.5 MiB, which
    # the cached 12 MiB block serves unsplit (0.5 MiB left, not more than kSmallSize): allocated
    # counts 12 MiB, where the live tensors hold 11.5.
    timeline = MemoryTimeline(
        node_count=2,
        forward_end=1,
        backward_end=2,
        allocations=(
            TimelineAllocation(0, 0, 12 * MiB, "temporaries", "aten.mm", None),
            TimelineAllocation(1, 1, 11 * MiB + 512 * KiB, "temporaries", "aten.mm", None),
        ),
    )
    assert allocator_peak_bytes(timeline) == (12 * MiB, 12 * MiB)


# The boundaries of CUDACachingAllocator.cpp's rules, each just below, at and just above, with the
# numbers its constants give: kMinBlockSize 512, kSmallSize 1 MiB, kSmallBuffer 2 MiB,
# kLargeBuffer 20 MiB, kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB.


def test_rounding_boundary_at_512_bytes() -> None:
    assert [round_size(n) for n in (0, 1024, 1025)] == [512, 1024, 1536]


def test_small_pool_boundary_at_1_mib() -> None:
    below, at, above = CachingAllocator(), CachingAllocator(), CachingAllocator()
    below.malloc(1 * MiB - 512)
    at.malloc(1 * MiB)
    above.malloc(1 * MiB + 1)  # rounds to 1 MiB + 512: the large pool
    assert [a.reserved_bytes for a in (below, at, above)] == [2 * MiB, 2 * MiB, 20 * MiB]


def test_own_segment_boundary_at_10_mib() -> None:
    assert segment_size(10 * MiB - 512) == 20 * MiB  # below kMinLargeAlloc: a 20 MiB buffer
    assert segment_size(10 * MiB) == 10 * MiB  # at it: its own segment, rounded to 2 MiB
    assert segment_size(10 * MiB + 512) == 12 * MiB


def test_small_pool_splits_down_to_a_512_byte_remainder() -> None:
    allocator = CachingAllocator()
    allocator.malloc(1 * MiB)  # a 2 MiB small segment, 1 MiB left
    allocator.malloc(1 * MiB - 512)  # leaves exactly 512 bytes: still split off
    assert allocator.allocated_bytes == 2 * MiB - 512
    allocator.malloc(512)  # fits in the remainder, no new segment
    assert allocator.segments == 1


def test_large_pool_splits_only_above_a_1_mib_remainder() -> None:
    exactly = CachingAllocator()
    exactly.free(exactly.malloc(12 * MiB))  # one free 12 MiB segment
    exactly.malloc(11 * MiB)  # would leave exactly 1 MiB: not more than kSmallSize, no split
    assert exactly.allocated_bytes == 12 * MiB
    more = CachingAllocator()
    more.free(more.malloc(12 * MiB))
    more.malloc(11 * MiB - 512)  # leaves 1 MiB + 512: split, the request gets what it asked
    assert more.allocated_bytes == 11 * MiB - 512


def test_freed_blocks_merge_with_both_neighbours_and_the_merged_block_is_reused_whole() -> None:
    """CUDACachingAllocator.cpp free_block/try_merge_blocks: a freed block absorbs a free previous
    and a free next block of its segment; best fit then finds the merged block at address 0."""
    allocator = CachingAllocator()
    a, b, c = (allocator.malloc(4 * MiB) for _ in range(3))  # one 20 MiB segment: a b c, 8 MiB free
    d = allocator.malloc(2 * MiB)  # 2 MiB after c, 6 MiB free
    allocator.free(a)
    allocator.free(c)  # c has an allocated block on each side: no merge
    assert allocator.segment_layout() == [
        (
            0,
            20 * MiB,
            False,
            [
                (0, 4 * MiB, None),
                (4 * MiB, 4 * MiB, b),
                (8 * MiB, 4 * MiB, None),
                (12 * MiB, 2 * MiB, d),
                (14 * MiB, 6 * MiB, None),
            ],
        )
    ]
    allocator.free(b)  # merges with a before it and c after it
    assert allocator.segment_layout()[0][3] == [(0, 12 * MiB, None), (12 * MiB, 2 * MiB, d), (14 * MiB, 6 * MiB, None)]
    allocator.free(d)  # merges with both: the segment is one free block again
    assert allocator.segment_layout() == [(0, 20 * MiB, False, [(0, 20 * MiB, None)])]
    assert allocator.allocated_bytes == 0
    whole = allocator.malloc(20 * MiB)  # exactly the merged block, at address 0: no new segment
    assert (allocator.segments, allocator.reserved_bytes, allocator.block(whole)) == (1, 20 * MiB, (0, 20 * MiB))
    second = allocator.malloc(12 * MiB)  # a second segment starts where the first ends
    assert allocator.block(second) == (20 * MiB, 12 * MiB)
    third = allocator.malloc(14 * MiB)  # and a third where the second ends: segments never overlap
    assert allocator.block(third) == (32 * MiB, 14 * MiB)
    assert [segment[:2] for segment in allocator.segment_layout()] == [
        (0, 20 * MiB),
        (20 * MiB, 12 * MiB),
        (32 * MiB, 14 * MiB),
    ]
    assert allocator.max_allocated_bytes == 46 * MiB


def test_neighbour_links_survive_splits_and_merges() -> None:
    """After a split or a merge, the next block's `prev` must point at the block now before it, or a
    later free cannot merge backwards (the segment would stay in pieces)."""
    allocator = CachingAllocator()
    assert (allocator.max_allocated_bytes, allocator.max_reserved_bytes) == (0, 0)
    p, q, r = (allocator.malloc(4 * MiB) for _ in range(3))  # p q r, then 8 MiB free
    allocator.free(p)
    allocator.free(q)  # q merges into p; r, still allocated, now follows the merged block
    allocator.free(r)  # r merges backwards into p+q and forwards into the free tail
    assert allocator.segment_layout() == [(0, 20 * MiB, False, [(0, 20 * MiB, None)])]

    x, y, z = (allocator.malloc(4 * MiB) for _ in range(3))
    allocator.free(x)
    head = allocator.malloc(2 * MiB)  # splits x's 4 MiB: head, then 2 MiB free before y
    assert allocator.block(head) == (0, 2 * MiB)
    allocator.free(y)  # y merges backwards into that 2 MiB remainder
    assert allocator.segment_layout()[0][3] == [
        (0, 2 * MiB, head),
        (2 * MiB, 6 * MiB, None),
        (8 * MiB, 4 * MiB, z),
        (12 * MiB, 8 * MiB, None),
    ]


# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the truths are hand-computed from the rules of
# CUDACachingAllocator.cpp's expandable path (one segment per pool grown in 20 MiB / 2 MiB pages,
# the end block taken last, any remainder of 512 bytes or more split off).


def _expandable() -> CachingAllocator:
    from memplan.estimator.cuda.allocator import AllocatorConfig

    return CachingAllocator(AllocatorConfig(expandable_segments=True))


def test_an_expandable_segment_grows_in_20mib_pages_from_its_free_end() -> None:
    allocator = _expandable()
    for _ in range(3):
        allocator.malloc(6 * MiB)  # 18 of the first 20 MiB page
    assert (allocator.segments, allocator.reserved_bytes) == (1, 20 * MiB)
    allocator.malloc(12 * MiB)  # the 2 MiB free end + 10 MiB more: one more page, not a 12 MiB segment
    assert (allocator.segments, allocator.reserved_bytes) == (1, 40 * MiB)
    default = CachingAllocator()
    for _ in range(3):
        default.malloc(6 * MiB)
    default.malloc(12 * MiB)
    assert (default.segments, default.reserved_bytes) == (2, 32 * MiB)


def test_an_expandable_segment_splits_any_remainder_of_512_bytes() -> None:
    allocator = _expandable()
    allocator.malloc(19 * MiB + 512 * KiB)  # leaves 0.5 MiB: split off (the default keeps the block whole)
    assert allocator.allocated_bytes == 19 * MiB + 512 * KiB
    assert allocator.malloc(256 * KiB) is not None and allocator.reserved_bytes == 20 * MiB + 2 * MiB
    default = CachingAllocator()
    default.malloc(19 * MiB + 512 * KiB)
    assert default.allocated_bytes == 20 * MiB


def test_the_free_end_of_an_expandable_segment_is_taken_last() -> None:
    allocator = _expandable()
    first = allocator.malloc(8 * MiB)  # [0, 8) from the segment's start
    base = allocator.block(first)[0]
    allocator.malloc(6 * MiB)  # [8, 14); the free end is [14, 20): 6 MiB
    allocator.free(first)
    # 5 MiB: the free end (6 MiB) is the smallest fit, but counts as large as it could grow.
    taken = allocator.malloc(5 * MiB)
    assert allocator.block(taken) == (base, 5 * MiB)
    # 6 MiB now fits only the free end (the first block has 3 MiB left): it is taken, nothing is mapped.
    end = allocator.malloc(6 * MiB)
    assert allocator.block(end) == (base + 14 * MiB, 6 * MiB) and allocator.reserved_bytes == 20 * MiB


def test_a_large_segment_size_sizes_the_segments_and_pages_of_1_to_10_mib_requests() -> None:
    """large_segment_size_mb:64 (torch 2.11+): a 6 MiB request gets a 64 MiB segment (get_allocation_size), a
    second fits in it; with expandable segments the large pool maps 64 MiB pages (find_expandable_block)."""
    from memplan.estimator.cuda.allocator import AllocatorConfig

    for expandable in (False, True):
        allocator = CachingAllocator(AllocatorConfig(expandable_segments=expandable, large_segment_bytes=64 * MiB))
        allocator.malloc(6 * MiB)
        allocator.malloc(6 * MiB)
        assert (allocator.segments, allocator.reserved_bytes) == (1, 64 * MiB)
        allocator.malloc(60 * MiB)  # from 10 MiB on: a segment of its own (2 MiB-rounded), or one more page
        assert allocator.reserved_bytes == (128 if expandable else 124) * MiB


def test_an_expandable_pool_past_its_addresses_is_refused_not_overlapped() -> None:
    """Each pool's one segment spans 5 << 46 addresses (320 TiB, more than any device); a step that maps
    more made a second segment at the same base, whose blocks overlapped the first's (a traced batch of
    2^20 ended in an AssertionError or a KeyError)."""
    from memplan.errors import SettingsError

    allocator = _expandable()
    first = allocator.malloc(3 << 46)
    assert first is not None and allocator.reserved_bytes == -(-(3 << 46) // (20 * MiB)) * 20 * MiB  # whole pages
    with pytest.raises(SettingsError, match="more than 320 TiB in one pool"):
        allocator.malloc(3 << 46)


def test_freed_blocks_merge_into_the_end_and_small_requests_share_2mib_pages() -> None:
    allocator = _expandable()
    allocator.malloc(6 * MiB)
    second = allocator.malloc(6 * MiB)
    allocator.free(second)  # merges with the 8 MiB free end: 14 MiB free from 6 MiB on
    allocator.malloc(13 * MiB)
    assert allocator.reserved_bytes == 20 * MiB and allocator.segments == 1
    small = _expandable()
    for _ in range(21):
        small.malloc(100 * KiB)  # 2,100 KiB: a second 2 MiB page of the same segment
    assert (small.segments, small.reserved_bytes) == (1, 4 * MiB)


def test_pytorch_cuda_alloc_conf_is_read_as_torch_reads_it() -> None:
    import pytest

    from memplan.estimator.cuda.allocator import AllocatorConfig, parse_alloc_conf

    assert parse_alloc_conf("expandable_segments:True") == (AllocatorConfig(True), ())
    assert parse_alloc_conf("max_split_size_mb:128, expandable_segments:False") == (
        AllocatorConfig(False, max_split_size_bytes=128 * MiB),
        (),
    )
    # AllocatorConfig.cpp parseRoundUpPower2Divisions: interval k (0..15) is [2**k, 2**(k+1)) MiB;
    # the first entry also fills the intervals below it, `>` every interval after the last entry.
    config, unmodelled = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2],expandable_segments:True")
    assert (config.expandable_segments, unmodelled) == (True, ())
    assert config.roundup_power2_divisions == (1,) * 9 + (2,) + (0,) * 6
    config, _ = parse_alloc_conf("roundup_power2_divisions:[64:8, 128:4, >:2]")
    assert config.roundup_power2_divisions == (8,) * 7 + (4,) + (2,) * 8
    assert parse_alloc_conf("roundup_power2_divisions:4")[0].roundup_power2_divisions == (4,) * 16
    # `>` fills from the interval after the last entry (the first, index 0, when it comes first),
    # entries after it still apply (the first of them filling below itself), and an interval past
    # 32 GiB counts as the last one.
    assert parse_alloc_conf("roundup_power2_divisions:[>:4]")[0].roundup_power2_divisions == (0,) + (4,) * 15
    config, _ = parse_alloc_conf("roundup_power2_divisions:[>:2,64:8]")
    assert config.roundup_power2_divisions == (8,) * 7 + (2,) * 9
    config, _ = parse_alloc_conf("roundup_power2_divisions:[65536:2]")
    assert config.roundup_power2_divisions == (2,) * 16
    assert parse_alloc_conf("backend:cudaMallocAsync,pinned_use_cuda_host_register:True")[1] == (
        "backend",
        "pinned_use_cuda_host_register",
    )
    assert parse_alloc_conf("garbage_collection_threshold:0.6")[0].garbage_collection_threshold == 0.6
    # torch 2.11+'s large_segment_size_mb: the 1-10 MiB requests' segment, and the split limits' floor in either order
    large = parse_alloc_conf("large_segment_size_mb:64")[0]
    assert (large.large_segment_bytes, large.max_non_split_rounding_bytes) == (64 * MiB, 20 * MiB)
    for text in ("large_segment_size_mb:64,max_split_size_mb:40", "max_split_size_mb:40,large_segment_size_mb:64"):
        with pytest.raises(ValueError, match="max_split_size_mb too small, must be >= 64"):
            parse_alloc_conf(text)
    capped = parse_alloc_conf("per_process_memory_fraction:0.5")
    assert capped == (AllocatorConfig(per_process_memory_fraction=0.5), ())  # modelled, not a noted key
    rounding = parse_alloc_conf("max_non_split_rounding_mb:30")[0]
    assert (rounding.max_non_split_rounding_bytes, rounding.max_split_size_bytes) == (30 * MiB, None)
    for text, reason in (
        ("expandable_segments:true", "takes True or False"),
        ("expandable:True", "unknown option 'expandable'"),
        ("expandable_segments", "is not key:value"),
        ("max_split_size_mb:19", "must be >= 20"),  # kLargeBuffer / 1 MB
        ("max_non_split_rounding_mb:8", "must be >= 20"),
        ("max_split_size_mb:1.5", "whole number"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("roundup_power2_divisions:[256:3]", "power of 2 or 0"),
        ("roundup_power2_divisions:[300:2]", "intervals must be powers of 2"),
        ("roundup_power2_divisions:[256:2", "closing"),
        ("garbage_collection_threshold:1.0", r"in \(0.0, 1.0\)"),
        ("garbage_collection_threshold:0", r"in \(0.0, 1.0\)"),
        ("per_process_memory_fraction:1.5", r"in \[0.0, 1.0\]"),  # torch: "set it in [0.0, 1.0]"
        ("per_process_memory_fraction:half", "takes a number"),
        ("large_segment_size_mb:10", "must be > 10 MB"),  # parseLargeSegmentSize: > kMinLargeAlloc / kMB
        # what torch 2.11 refuses at start-up for the keys memplan only notes (helper-20's check on the real build)
        ("backend:bogus", "native or cudaMallocAsync"),
        ("release_lock_on_cudamalloc:maybe", "takes True or False"),
        ("pinned_use_cuda_host_register:yes", "takes True or False"),
        ("pinned_num_register_threads:3", "power of 2 up to 128"),
        ("pinned_num_register_threads:256", "power of 2 up to 128"),
        (",expandable_segments:True", "an empty option"),  # torch: "Unrecognized key ','"
        ("expandable_segments:True,,max_split_size_mb:128", "an empty option"),
        ("roundup_power2_divisions:x", "^roundup_power2_divisions takes a whole number, got 'x'$"),
        ("roundup_power2_divisions:[4:x]", "^roundup_power2_divisions takes a whole number, got 'x'$"),
        ("roundup_power2_divisions:[4:2:1]", "^roundup_power2_divisions takes a whole number, got '2:1'$"),
        ("roundup_power2_divisions:[x:4]", "^roundup_power2_divisions interval takes a whole number, got 'x'$"),
        ("roundup_power2_divisions:[4]", "^roundup_power2_divisions entry '4' is not MB:divisions$"),
        ("max_split_size_mb:x", "^max_split_size_mb takes a whole number, got 'x'$"),
        ("roundup_power2_divisions:0", "must be a power of 2"),  # 0 only inside a list
        ("garbage_collection_threshold:high", "takes a number"),
    ):
        with pytest.raises(ValueError, match=reason):
            parse_alloc_conf(text)


# A device of limited memory: on a failed cudaMalloc, release_cached_blocks frees every wholly free
# cached segment and the cudaMalloc is tried once more (DeviceCachingAllocator::malloc).


def test_a_full_device_frees_cached_free_segments_and_retries() -> None:
    import pytest

    from memplan.estimator.cuda.allocator import OutOfMemory

    allocator = CachingAllocator(capacity_bytes=40 * MiB)
    allocator.free(allocator.malloc(8 * MiB))  # a cached, wholly free 20 MiB segment
    allocator.malloc(30 * MiB)  # 20 + 30 > 40: the cached segment goes, then 30 MiB fits
    assert (allocator.segments, allocator.reserved_bytes) == (1, 30 * MiB)
    with pytest.raises(OutOfMemory):
        allocator.malloc(12 * MiB)  # 30 + 12 > 40 and nothing cached is free
    split = CachingAllocator(capacity_bytes=30 * MiB)
    first = split.malloc(8 * MiB)
    split.malloc(4 * MiB)  # the same 20 MiB segment
    split.free(first)  # free space inside a segment that is not wholly free: kept
    with pytest.raises(OutOfMemory):
        split.malloc(11 * MiB)  # 20 + 12 > 30
    unlimited = CachingAllocator()
    unlimited.free(unlimited.malloc(8 * MiB))
    unlimited.malloc(30 * MiB)
    assert unlimited.reserved_bytes == 50 * MiB


def test_the_smallest_device_is_the_allocated_peak_when_cached_segments_can_go() -> None:
    from memplan.estimator.timeline import (
        MemoryTimeline,
        TimelineAllocation,
        completes_within,
        reserved_peak_bytes,
        smallest_device_bytes,
    )

    def request(start: int, end: int, size: int) -> TimelineAllocation:
        return TimelineAllocation(start, end, size, "temporaries", "op", None)

    # 8 MiB (a 20 MiB segment), freed; then 30 MiB (its own segment): 50 MiB reserved unconstrained,
    # but the 20 MiB segment is wholly free when the 30 MiB one is asked for, so 30 MiB is enough.
    timeline = MemoryTimeline(4, 2, 3, (request(0, 1, 8 * MiB), request(2, 3, 30 * MiB)))
    assert reserved_peak_bytes(timeline) == 50 * MiB
    assert smallest_device_bytes(timeline, 30 * MiB, reserved_peak_bytes(timeline)) == 30 * MiB
    assert completes_within(timeline, 30 * MiB) and not completes_within(timeline, 28 * MiB)
    # Both alive at once: nothing can be released, the reserved peak is the smallest device.
    together = MemoryTimeline(4, 2, 3, (request(0, 2, 8 * MiB), request(1, 3, 30 * MiB)))
    assert reserved_peak_bytes(together) == 50 * MiB  # 38 MiB allocated at once
    assert smallest_device_bytes(together, 38 * MiB, 50 * MiB) == 50 * MiB


def test_the_issues_own_sequences() -> None:
    """Issue 21's hand-computed cases: ten live 7 MiB tensors reserve 100 MiB by default (two per 20
    MiB segment) and 80 MiB with expandable segments (70 MiB in 20 MiB pages); a freed 30 MiB block
    then a 32 MiB request on a 60 MiB device completes after one retry with 32 MiB reserved."""
    default, expandable = CachingAllocator(), _expandable()
    for allocator in (default, expandable):
        for _ in range(10):
            allocator.malloc(7 * MiB)
    assert (default.reserved_bytes, expandable.reserved_bytes) == (100 * MiB, 80 * MiB)
    device = CachingAllocator(capacity_bytes=60 * MiB)
    device.free(device.malloc(30 * MiB))
    device.malloc(32 * MiB)
    assert device.reserved_bytes == 32 * MiB


def test_an_expandable_segment_appends_pages_after_a_busy_end_and_keeps_its_blocks_linked() -> None:
    allocator = _expandable()
    first = allocator.malloc(20 * MiB)  # exactly one page: the end block is busy
    base = allocator.block(first)[0]
    second = allocator.malloc(20 * MiB)  # a new page right after it
    assert allocator.block(second) == (base + 20 * MiB, 20 * MiB)
    assert (allocator.segments, allocator.reserved_bytes, allocator.max_reserved_bytes) == (1, 40 * MiB, 40 * MiB)
    assert [address for address, _, _ in allocator.segment_layout()[0][3]] == [base, base + 20 * MiB]
    allocator.free(first)
    allocator.free(second)  # merges with the first: one 40 MiB free block
    whole = allocator.malloc(40 * MiB)
    assert allocator.block(whole) == (base, 40 * MiB) and allocator.reserved_bytes == 40 * MiB
    allocator.malloc(512 * KiB)  # the small pool has its own segment
    assert allocator.segments == 2


def test_an_expandable_segment_maps_only_what_its_free_end_lacks() -> None:
    allocator = _expandable()
    allocator.malloc(12 * MiB)  # the free end: 8 MiB
    allocator.malloc(25 * MiB)  # 8 MiB + 17 MiB more: one page, 40 MiB in all
    assert allocator.reserved_bytes == 40 * MiB
    merged = _expandable()
    merged.malloc(6 * MiB)
    merged.free(merged.malloc(6 * MiB))  # merges into the free end: 14 MiB from 6 MiB on
    merged.malloc(30 * MiB)  # that end + 16 MiB: one more page of the same segment
    assert (merged.segments, merged.reserved_bytes) == (1, 40 * MiB)
    exact = _expandable()
    exact.malloc(20 * MiB - 512)  # a 512-byte remainder is split off
    assert exact.allocated_bytes == 20 * MiB - 512


def test_the_free_end_is_passed_over_for_the_next_larger_block_not_a_smaller_one() -> None:
    allocator = _expandable()
    small = allocator.malloc(2 * MiB)
    allocator.malloc(1536 * KiB)
    larger = allocator.malloc(8 * MiB)
    allocator.malloc(2 * MiB)  # 13.5 MiB used; the free end: 6.5 MiB
    address = allocator.block(larger)[0]
    allocator.free(small)
    allocator.free(larger)  # free: 2 MiB, the 6.5 MiB end, 8 MiB
    taken = allocator.malloc(5 * MiB)
    assert allocator.block(taken) == (address, 5 * MiB)


def test_a_device_holds_exactly_its_capacity_and_releases_every_free_segment() -> None:
    import pytest

    from memplan.estimator.cuda.allocator import OutOfMemory

    exact = CachingAllocator(capacity_bytes=30 * MiB)
    exact.malloc(30 * MiB)
    assert exact.reserved_bytes == 30 * MiB
    with pytest.raises(OutOfMemory, match="20,971,520 B more than the 31,457,280 B device holds"):  # a 20 MiB segment
        exact.malloc(2 * MiB)
    device = CachingAllocator(capacity_bytes=60 * MiB)
    busy = device.malloc(20 * MiB)
    device.free(device.malloc(12 * MiB))
    device.free(device.malloc(14 * MiB))  # 46 MiB reserved, 26 of it free after the busy segment
    device.malloc(30 * MiB)  # both free segments go: 20 + 30 MiB
    assert (device.reserved_bytes, device.segments) == (50 * MiB, 2)
    assert [size for _, size, _, _ in device.segment_layout()] == [20 * MiB, 30 * MiB]
    assert device.block(busy)[1] == 20 * MiB


def test_pytorch_cuda_alloc_conf_messages_and_defaults() -> None:
    import pytest

    from memplan.estimator.cuda.allocator import AllocatorConfig, parse_alloc_conf

    assert parse_alloc_conf("max_split_size_mb:64") == (AllocatorConfig(max_split_size_bytes=64 * MiB), ())
    with pytest.raises(ValueError, match="'expandable_segments:' is not key:value"):
        parse_alloc_conf("expandable_segments:")
    with pytest.raises(ValueError, match="torch knows backend, expandable_segments, garbage_collection"):
        parse_alloc_conf("nope:1")


def test_a_cudamalloc_that_fits_exactly_releases_nothing() -> None:
    device = CachingAllocator(capacity_bytes=42 * MiB)
    device.free(device.malloc(8 * MiB))  # a cached free 20 MiB segment
    device.malloc(22 * MiB)  # 20 + 22 = 42 MiB: the cudaMalloc succeeds, the cache stays
    assert (device.reserved_bytes, device.segments) == (42 * MiB, 2)


# PYTORCH_CUDA_ALLOC_CONF's other options, each against numbers worked out from
# CUDACachingAllocator.cpp's functions (torch 2.11-2.14).


def test_roundup_power2_divisions_round_to_the_next_division_between_powers_of_two() -> None:
    """round_size / roundup_power2_next_division, with the source's own example (1200 B in 4
    divisions of 1024..2048 is 1280 B), and the guard: at most 512 B x divisions, 512-byte blocks."""
    from memplan.estimator.cuda.allocator import AllocatorConfig

    four = AllocatorConfig(roundup_power2_divisions=(4,) * 16)
    assert round_size(1200, AllocatorConfig(roundup_power2_divisions=(1,) * 16)) == 1536  # 1: plain blocks
    assert [round_size(n, four) for n in (1200, 2048, 2049, 3000, 4096)] == [1536, 2048, 2560, 3072, 4096]
    eight = AllocatorConfig(roundup_power2_divisions=(8,) * 16)
    assert round_size(1200, AllocatorConfig(roundup_power2_divisions=(2,) * 16)) == 1536  # 1200 > 1024: 1024..2048 in 2
    assert round_size(5000, eight) == 5120  # 4096..8192 in steps of 512
    assert round_size(100 * MiB + 1, four) == 112 * MiB  # 64..128 MiB in steps of 16 MiB
    assert round_size(100 * MiB + 1, eight) == 104 * MiB
    # The divisions of the interval the size falls in: 1-2 MiB is interval 0, anything smaller too.
    by_interval = AllocatorConfig(roundup_power2_divisions=(2,) + (0,) * 5 + (4,) + (0,) * 9)
    assert round_size(3000, by_interval) == 3072  # below 1 MiB: interval 0, 2 divisions of 2048..4096
    assert round_size(MiB + 1, by_interval) == 3 * MiB // 2
    assert round_size(2 * MiB + 1, by_interval) == 2 * MiB + 512  # interval 1: no rounding configured
    assert round_size(65 * MiB, by_interval) == 80 * MiB  # 64..128 MiB: interval 6, 4 divisions
    # Sizes from 32 GiB up share the last interval: 100 GiB in 4 divisions of 64..128 GiB.
    last = AllocatorConfig(roundup_power2_divisions=(0,) * 15 + (4,))
    assert round_size(100 * 2**30, last) == 112 * 2**30
    assert round_size(40 * 2**30 + 1, last) == 48 * 2**30
    device = CachingAllocator(four)
    device.malloc(100 * MiB + 1)
    assert (device.allocated_bytes, device.reserved_bytes) == (112 * MiB, 112 * MiB)


def test_max_split_size_keeps_oversize_blocks_whole_and_away_from_small_requests() -> None:
    """With max_split_size_mb:40, a freed 60 MiB segment is oversize: a 30 MiB request may not
    take it (a new 30 MiB segment), a 50 MiB request may (60 < 50 + 20) and gets it whole (no
    split at or above the limit: 60 MiB allocated), a 38 MiB request below the limit may not."""
    from memplan.estimator.cuda.allocator import AllocatorConfig

    config = AllocatorConfig(max_split_size_bytes=40 * MiB)
    device = CachingAllocator(config)
    device.free(device.malloc(60 * MiB))
    small = device.malloc(30 * MiB)
    assert (device.reserved_bytes, device.segments) == (90 * MiB, 2)
    device.free(small)
    big = device.malloc(50 * MiB)
    assert (device.reserved_bytes, device.allocated_bytes) == (90 * MiB, 60 * MiB)
    assert device.block(big) == (0, 60 * MiB)
    device.free(big)
    device.malloc(38 * MiB)  # the 30 MiB block is too small, the 60 MiB one oversize: cudaMalloc
    assert device.reserved_bytes == 128 * MiB
    # Without the option the same requests reuse and split the first segment.
    plain = CachingAllocator()
    plain.free(plain.malloc(60 * MiB))
    plain.malloc(30 * MiB)
    assert (plain.reserved_bytes, plain.segments) == (60 * MiB, 1)


def test_an_oversize_block_serves_a_large_request_only_within_the_rounding_limit() -> None:
    """get_free_block: refused when block >= request + max_non_split_rounding (20 MiB default)."""
    from memplan.estimator.cuda.allocator import AllocatorConfig

    for rounding, request, reused in ((20, 41, True), (20, 40, False), (30, 40, True), (30, 30, False)):
        config = AllocatorConfig(max_split_size_bytes=20 * MiB, max_non_split_rounding_bytes=rounding * MiB)
        device = CachingAllocator(config)
        device.free(device.malloc(60 * MiB))
        device.malloc(request * MiB)
        assert (device.reserved_bytes == 60 * MiB) is reused, (rounding, request)


def test_below_the_limit_large_blocks_still_split() -> None:
    """should_split: a request below max_split_size splits a large block (remainder > 1 MiB), so
    a 4 MiB request takes the front of a 20 MiB segment and a second one the next 4 MiB. With the
    limit at 20 MiB the 20 MiB segment itself counts as oversize once wholly free."""
    from memplan.estimator.cuda.allocator import AllocatorConfig

    device = CachingAllocator(AllocatorConfig(max_split_size_bytes=20 * MiB))
    first, second = device.malloc(4 * MiB), device.malloc(4 * MiB)
    assert [device.block(first), device.block(second)] == [(0, 4 * MiB), (4 * MiB, 4 * MiB)]
    assert device.reserved_bytes == 20 * MiB
    device.free(first)
    device.free(second)  # the segment is one free 20 MiB block again: oversize
    device.malloc(4 * MiB)
    assert (device.reserved_bytes, device.segments) == (40 * MiB, 2)


def test_out_of_memory_frees_oversize_segments_before_the_whole_cache() -> None:
    """release_available_cached_blocks, by hand. (1) max_split_size_mb:20, a 200 MiB device,
    cached free segments of 60, 50 and 40 MiB: a 70 MiB request finds no block, its cudaMalloc
    (150 + 70 > 200) fails; no cached segment holds 70 MiB, so the largest go until 70 MiB are
    freed (60, then 50) and the cudaMalloc succeeds: 40 + 70 MiB. (2) max_split_size_mb:64,
    cached 80 and 100 MiB: a 30 MiB request may not take either (oversize), its cudaMalloc
    (180 + 30 > 200) fails, and the smallest oversize segment of at least 64 MiB (80) goes:
    100 + 30 MiB. Releasing the whole cache instead would leave 30 MiB."""
    from memplan.estimator.cuda.allocator import AllocatorConfig

    device = CachingAllocator(AllocatorConfig(max_split_size_bytes=20 * MiB), capacity_bytes=200 * MiB)
    for handle in [device.malloc(size * MiB) for size in (60, 50, 40)]:
        device.free(handle)
    device.malloc(70 * MiB)
    assert (device.reserved_bytes, device.segments) == (110 * MiB, 2)
    device = CachingAllocator(AllocatorConfig(max_split_size_bytes=64 * MiB), capacity_bytes=200 * MiB)
    for handle in [device.malloc(size * MiB) for size in (80, 100)]:
        device.free(handle)
    device.malloc(30 * MiB)
    assert (device.reserved_bytes, device.segments) == (130 * MiB, 2)
    # Oversize segments that cannot free enough: all of them go, then release_cached_blocks the
    # rest (a cached 10 MiB segment), and the cudaMalloc is tried once more.
    device = CachingAllocator(AllocatorConfig(max_split_size_bytes=64 * MiB), capacity_bytes=100 * MiB)
    for handle in [device.malloc(size) for size in (10 * MiB, 70 * MiB)]:
        device.free(handle)
    device.malloc(90 * MiB)
    assert (device.reserved_bytes, device.segments) == (90 * MiB, 1)
    # Without the option the 30 MiB request splits the cached 80 MiB segment, and a request no
    # cached block holds makes release_cached_blocks free every wholly free segment at once.
    plain = CachingAllocator(capacity_bytes=200 * MiB)
    for handle in [plain.malloc(size * MiB) for size in (80, 100)]:
        plain.free(handle)
    plain.malloc(30 * MiB)
    assert (plain.reserved_bytes, plain.segments) == (180 * MiB, 2)
    plain.malloc(110 * MiB)
    assert (plain.reserved_bytes, plain.segments) == (190 * MiB, 2)  # 80 (in use) + 110; 100 freed


def test_oversize_release_boundaries() -> None:
    """release_available_cached_blocks at its edges, by hand: (1) a cached oversize segment exactly
    the size wanted, at address 0, is the one freed; (2) freeing the largest ones stops as soon as
    what is freed reaches the request (70 of 70 MiB: the 26 MiB one stays); (3) a segment exactly
    at the limit counts as oversize (60 then 40 freed for 90; the 10 MiB one below the limit stays)."""
    from memplan.estimator.cuda.allocator import AllocatorConfig

    def cached(limit_mib: int, capacity_mib: int, sizes: list[int]) -> CachingAllocator:
        device = CachingAllocator(AllocatorConfig(max_split_size_bytes=limit_mib * MiB), capacity_mib * MiB)
        for handle in [device.malloc(size * MiB) for size in sizes]:
            device.free(handle)
        return device

    device = cached(64, 190, [64, 100])
    assert device.block(device.malloc(30 * MiB))[0] == 164 * MiB  # a new segment after the 100 MiB one
    assert (device.reserved_bytes, device.segments) == (130 * MiB, 2)
    device = cached(20, 100, [40, 30, 25])  # the 25 MiB request's segment: 26 MiB (2 MiB rounding)
    device.malloc(70 * MiB)
    assert (device.reserved_bytes, device.segments) == (96 * MiB, 2)
    device = cached(40, 120, [60, 40, 10])
    device.malloc(90 * MiB)
    assert (device.reserved_bytes, device.segments) == (100 * MiB, 2)


# Out of memory on the expandable path (CUDACachingAllocator.cpp, torch 2.11-2.14): a mapping that
# fails makes release_cached_blocks unmap every page wholly inside a cached free block, wherever it
# lies; find_expandable_block then takes the lowest-address unmapped range whose run of free and
# unmapped blocks holds the request. Positions below are MiB from the segment's start, by hand.


def _expandable_device(capacity_mib: int, stream: int = 0) -> CachingAllocator:
    """An expandable-segment allocator on a device of `capacity_mib`, every request on `stream`
    (a stream's pools behave as the default stream's: the same numbers)."""
    from memplan.estimator.cuda.allocator import AllocatorConfig

    device = CachingAllocator(AllocatorConfig(expandable_segments=True), capacity_bytes=capacity_mib * MiB)
    on_stream = device.malloc
    device.malloc = lambda num_bytes: on_stream(num_bytes, stream)  # type: ignore[method-assign]
    return device


@pytest.mark.parametrize("stream", [0, 1])
def test_a_full_expandable_segment_unmaps_its_free_pages_and_maps_again_where_there_is_room(stream) -> None:
    device = _expandable_device(120, stream)
    a, b, c, x = (device.malloc(20 * MiB) for _ in range(4))  # pages [0, 80), one block each
    base = device.block(a)[0]
    device.free(a)
    device.free(c)  # two free blocks with b between them: they do not merge
    # 50 MiB: no free block holds it; three new pages after x would make 140 MiB. The retry unmaps
    # a's and c's pages (reserved 40 MiB: b and x); neither hole holds 50 MiB, so it goes after x,
    # on three fresh pages: [80, 130) taken, [130, 140) free, reserved 100 MiB.
    d = device.malloc(50 * MiB)
    assert device.block(d) == (base + 80 * MiB, 50 * MiB)
    assert (device.reserved_bytes, device.max_reserved_bytes) == (100 * MiB, 100 * MiB)
    # 15 MiB: the free 10 MiB at [130, 140) is too small; the lowest unmapped range that holds it
    # is the hole at [0, 20), ahead of the segment's end: one page there, reserved 120 MiB.
    p = device.malloc(15 * MiB)
    assert device.block(p) == (base, 15 * MiB) and device.reserved_bytes == 120 * MiB
    assert [(address - base, size) for address, size, _, _ in device.segment_layout()] == [
        (0, 40 * MiB),
        (60 * MiB, 80 * MiB),
    ]  # two runs of mapped memory around the hole at [40, 60), as torch's snapshot reports them
    unlimited = _expandable_device(1 << 20)
    a, _, c, _ = (unlimited.malloc(20 * MiB) for _ in range(4))
    unlimited.free(a)
    unlimited.free(c)
    unlimited.malloc(50 * MiB)  # without the retry: three new pages, 140 MiB
    assert unlimited.reserved_bytes == 140 * MiB


@pytest.mark.parametrize("stream", [0, 1])
def test_expandable_pages_partly_in_use_stay_mapped_and_can_run_a_device_out_of_memory(stream) -> None:
    from memplan.estimator.cuda.allocator import OutOfMemory

    device = _expandable_device(60, stream)
    a = device.malloc(30 * MiB)  # pages [0, 40): a at [0, 30), free [30, 40)
    device.malloc(25 * MiB)  # the free 10 MiB + one more page: [30, 55), free [55, 60); 60 MiB
    device.free(a)
    # 35 MiB: 60 MiB live at most, yet no layout of whole pages holds it. The retry unmaps only
    # [0, 20) of a's [0, 30) (the page [20, 40) is shared with the live block) and nothing of
    # [55, 60); [0, 30) is then 30 MiB of room, short of 35; the end needs two more pages (80 MiB).
    with pytest.raises(OutOfMemory, match="no room to map 36,700,160 B on a 62,914,560 B device"):
        device.malloc(35 * MiB)
    assert device.reserved_bytes == 40 * MiB
    # What the retry left mapped of a's pages, [20, 30), is a free block of this stream's pool:
    # 10 MiB land there, and again once freed, with no page mapped.
    first = device.malloc(10 * MiB)
    base = device.block(first)[0] - 20 * MiB
    device.free(first)
    again = device.malloc(10 * MiB)
    assert device.block(again) == (base + 20 * MiB, 10 * MiB) and device.reserved_bytes == 40 * MiB
    roomy = _expandable_device(80, stream)
    a = roomy.malloc(30 * MiB)
    roomy.malloc(25 * MiB)
    roomy.free(a)
    roomy.malloc(35 * MiB)  # after the same retry: [55, 90) on two new pages, 40 + 40 MiB
    assert roomy.reserved_bytes == 80 * MiB


# Streams (CUDACachingAllocator.cpp: BlockPool orders blocks by stream first and get_free_block stops
# at a block of another stream; release_available_cached_blocks looks only at the requesting
# stream's blocks; release_cached_blocks frees what every stream has cached). Numbers by hand.


def test_a_block_freed_on_one_stream_is_cached_for_that_stream_only() -> None:
    allocator = CachingAllocator()
    side = allocator.malloc(8 * MiB, stream=1)  # a 20 MiB segment for stream 1
    allocator.free(side)
    allocator.malloc(8 * MiB)  # the default stream cannot use it: a second 20 MiB segment
    assert (allocator.segments, allocator.reserved_bytes) == (2, 40 * MiB)
    allocator.malloc(8 * MiB, stream=1)  # stream 1 reuses its own cached block
    assert allocator.reserved_bytes == 40 * MiB
    split = CachingAllocator()
    first, second = split.malloc(2 * MiB, stream=1), split.malloc(4 * MiB, stream=1)  # splits of one segment
    split.free(second)
    split.free(first)  # the pieces merge back into stream 1's one free 20 MiB block
    split.malloc(20 * MiB, stream=1)
    assert split.reserved_bytes == 20 * MiB
    small = CachingAllocator()
    small.free(small.malloc(100 * KiB, stream=1))
    small.malloc(100 * KiB)  # the small pool is per stream too: two 2 MiB segments
    assert small.reserved_bytes == 4 * MiB
    expandable = _expandable()
    expandable.malloc(6 * MiB)
    expandable.malloc(6 * MiB, stream=1)  # each stream's pool has its own segment: two 20 MiB pages
    assert (expandable.segments, expandable.reserved_bytes) == (2, 40 * MiB)


def test_out_of_memory_releases_every_streams_cache_but_oversize_blocks_of_its_own_stream_first() -> None:
    from memplan.estimator.cuda.allocator import AllocatorConfig

    device = CachingAllocator(capacity_bytes=40 * MiB)
    device.free(device.malloc(20 * MiB, stream=1))
    device.malloc(30 * MiB)  # 20 + 30 > 40: stream 1's cached segment is released, then 30 MiB fit
    assert device.reserved_bytes == 30 * MiB
    limited = CachingAllocator(AllocatorConfig(max_split_size_bytes=20 * MiB), capacity_bytes=100 * MiB)
    limited.free(limited.malloc(40 * MiB, stream=1))  # an oversize cached segment of stream 1
    limited.free(limited.malloc(30 * MiB))  # and one of the default stream: 70 MiB reserved
    # 35 MiB (a 36 MiB segment): 106 > 100. release_available_cached_blocks looks at the default
    # stream only: its 30 MiB segment is released, short of the 35 wanted, so release_cached_blocks
    # follows and frees stream 1's 40 MiB too; the request then gets its segment alone. Had stream
    # 1's 40 MiB block been eligible, it alone would have gone (66 MiB reserved).
    limited.malloc(35 * MiB)
    assert limited.reserved_bytes == 36 * MiB


def test_the_timeline_replay_allocates_each_request_on_its_stream() -> None:
    from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation, reserved_peak_bytes

    def timeline(second_stream: int) -> MemoryTimeline:
        first = TimelineAllocation(0, 0, 8 * MiB, "temporaries", "aten.empty", None)
        second = TimelineAllocation(1, 1, 8 * MiB, "temporaries", "aten.empty", None, stream=second_stream)
        return MemoryTimeline(node_count=2, forward_end=1, backward_end=2, allocations=(first, second))

    # One stream: the second request reuses the first's freed block (one 20 MiB segment); on
    # another stream it cannot, and opens a segment of its own.
    assert reserved_peak_bytes(timeline(0)) == 20 * MiB
    assert reserved_peak_bytes(timeline(1)) == 40 * MiB
