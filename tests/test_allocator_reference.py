"""memplan's allocator simulator against an independent replay of PyTorch's rules.

tests/reference_allocator.py was written separately, from c10/cuda/CUDACachingAllocator.cpp alone
(DeviceCachingAllocator's malloc and its retry chain, free_block, try_merge_blocks, should_split,
get_free_block, the release functions, and the expandable path's find_expandable_block, map_block,
try_allocate_expandable_block, unmap_block), by an author who did not see
memplan/estimator/cuda/allocator.py. Agreement byte for byte on random request sequences, on full
devices and with expandable segments, is the evidence that both follow torch's rules and not each
other. (One stream only: the reference has no streams; per-stream pools are tested by hand in
tests/test_cuda_allocator.py.)
"""

import random

import pytest

from memplan.estimator.cuda.allocator import AllocatorConfig, CachingAllocator, OutOfMemory
from memplan.estimator.timeline import reserved_peak_bytes, smallest_device_bytes
from tests.reference_allocator import OutOfMemoryError, ReferenceAllocator
from tests.reference_replay import recorded_requests, reference_replay, reference_smallest_device

MiB = 1 << 20
# (expandable segments, device capacity, max_split_size): torch's default, three full devices,
# max_split_size_mb:32 and :64 (above torch's floor of 20), and expandable segments with and
# without a full device.
CONFIGS = [
    (False, None, None),
    (False, 160 * MiB, None),
    (False, 400 * MiB, None),
    (False, 1000 * MiB, 32 * MiB),
    (False, None, 64 * MiB),
    (False, 400 * MiB, 64 * MiB),
    (True, None, None),
    (True, 160 * MiB, None),
    (True, 400 * MiB, None),
]


def _request(rng: random.Random) -> int:
    """Small-pool requests, 1-10 MiB ones that share 20 MiB segments, and ones with a segment of their own."""
    kind = rng.random()
    if kind < 0.4:
        return rng.randint(1, MiB)
    if kind < 0.7:
        return rng.randint(MiB, 10 * MiB)
    if kind < 0.95:
        return rng.randint(10 * MiB, 60 * MiB)
    return rng.randint(60 * MiB, 200 * MiB)


@pytest.mark.parametrize(("expandable", "capacity", "split"), CONFIGS)
def test_random_requests_reserve_allocate_and_run_out_of_memory_as_the_reference_does(expandable, capacity, split):
    for seed in range(20):
        rng = random.Random(seed)
        reference = ReferenceAllocator(expandable, capacity, split)
        simulator = CachingAllocator(
            AllocatorConfig(expandable_segments=expandable, max_split_size_bytes=split), capacity
        )
        live: list[tuple[int, int]] = []
        for step in range(400):
            if live and rng.random() < 0.45:
                theirs, ours = live.pop(rng.randrange(len(live)))
                reference.free(theirs)
                simulator.free(ours)
            else:
                size = _request(rng)
                with_reference = with_simulator = None
                try:
                    with_reference = reference.malloc(size)
                except OutOfMemoryError:
                    pass
                try:
                    with_simulator = simulator.malloc(size)
                except OutOfMemory:
                    pass
                assert (with_reference is None) == (with_simulator is None), (seed, step, size)
                if with_reference is not None:
                    live.append((with_reference, with_simulator))
            ours = (simulator.reserved_bytes, simulator.allocated_bytes, simulator.max_reserved_bytes)
            theirs = (reference.reserved_bytes, reference.allocated_bytes, reference.max_reserved_bytes)
            assert ours == theirs, (seed, step)


@pytest.mark.parametrize("expandable", [False, True])
def test_a_traced_steps_reserved_peak_and_smallest_device_equal_the_references(expandable):
    """The steady-state replay of a real traced step (a small conv + attention net, fp32 SGD at batch
    8 on an A100, whose step completes in well under its reserved peak: 90 of 148 MiB by default, 90
    of 146 MiB with expandable segments, cuDNN going without the workspaces that do not fit): the
    reserved peak, and the least capacity the reference completes the same requests in (bisected
    here, in the 2 MiB steps segments and pages come in), equal memplan's."""
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from memplan.settings import TrainingSettings
    from tests.test_simulate import _conv_attention_spec

    settings = TrainingSettings(batch_size=8, optimizer="sgd", gpu="A100-40GB")
    timeline = simulate(trace_step(_conv_attention_spec(), settings)).timeline
    calls = recorded_requests(timeline)
    config = AllocatorConfig(expandable_segments=expandable)
    reserved = reserved_peak_bytes(timeline, config)
    assert reserved == reference_replay(calls, expandable, None).max_reserved_bytes
    allocated = max(timeline.total_bytes())
    smallest = smallest_device_bytes(timeline, allocated, reserved, config)
    assert smallest == reference_smallest_device(calls, expandable, allocated, reserved) < reserved


def test_a_fit_is_decided_at_the_budget_because_the_retry_is_not_monotone_in_capacity():
    """Seven requests (MiB, live from node to node) that complete on a 136 MiB device, run out on
    138 MiB (the larger device keeps a segment the smaller one had to free, and the next request
    no longer finds room) and complete again on 140: the reference says so, and memplan's fit at a
    budget replays that budget instead of comparing it with the least capacity found."""
    from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation, device_fit_bytes, fits_within

    requests = ((1, 3, 45), (2, 3, 16), (3, 4, 16), (4, 6, 60), (5, 6, 60), (6, 6, 8))
    allocations = tuple(
        TimelineAllocation(start, end, size * MiB, "activations", "op", None) for start, end, size in requests
    )
    timeline = MemoryTimeline(node_count=7, forward_end=3, backward_end=6, allocations=allocations)
    calls = recorded_requests(timeline)

    def reference_completes(capacity_mib: int) -> bool:
        try:
            reference_replay(calls, False, capacity_mib * MiB)
        except OutOfMemoryError:
            return False
        return True

    assert [reference_completes(mib) for mib in (134, 136, 138, 140)] == [False, True, False, True]
    assert [fits_within(timeline, mib * MiB) for mib in (134, 136, 138, 140)] == [False, True, False, True]
    assert device_fit_bytes(timeline) == 136 * MiB  # the figure shown: the least capacity bisection found
