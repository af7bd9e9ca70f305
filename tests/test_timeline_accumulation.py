"""Gradient accumulation in the steady-state replay: the first micro-batch makes the gradients.

With zero_grad(set_to_none=True) after the step, an iteration's first micro-batch finds no
gradients, and AccumulateGrad keeps each new gradient as `.grad`; later micro-batches add into it.
The truths here are request orders worked out by hand, and counts of the model's own parameters.
"""

from memplan.estimator.cuda.allocator import CachingAllocator
from memplan.estimator.simulate import simulate
from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation, replay_steady_state, reserved_peak_bytes
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

MiB = 2**20


def _timeline(micro_batches: int) -> tuple[MemoryTimeline, TimelineAllocation, TimelineAllocation]:
    """Nodes 0-1 forward, 2-3 backward, 4 the step: a 40 MiB activation, a 20 MiB new gradient made
    at node 2 and added into the 20 MiB gradient at node 3, a 2 MiB temporary of the step."""
    weights = TimelineAllocation(0, 5, 20 * MiB, "parameters", "placeholder", None)
    gradient = TimelineAllocation(0, 5, 20 * MiB, "gradients", "placeholder", None, made_in_first_micro_batch=True)
    activation = TimelineAllocation(0, 2, 40 * MiB, "activations", "aten.mm.default", None)
    new_gradient = TimelineAllocation(2, 3, 20 * MiB, "temporaries", "aten.mm.default", None, becomes_gradient=True)
    step = TimelineAllocation(4, 4, 2 * MiB, "temporaries", "aten.mul.Tensor", None)
    allocations = (weights, gradient, activation, new_gradient, step)
    return MemoryTimeline(5, 2, 4, allocations, micro_batches), gradient, new_gradient


def _events(timeline: MemoryTimeline) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    names = {id(a): f"{a.category}@{a.allocated_at}" for a in timeline.allocations}
    replay_steady_state(timeline, CachingAllocator(), lambda action, _, a: events.append((action, names[id(a)])))
    return events


def test_the_first_micro_batch_keeps_its_new_gradients_until_zero_grad() -> None:
    timeline, _, _ = _timeline(micro_batches=4)
    events = _events(timeline)
    assert ("persistent", "gradients@0") not in events  # never allocated before the iteration
    last_iteration = events[events.index(("alloc", "activations@0")) :]
    # Three micro-batches replayed (first, one between, last): the first keeps its new gradient,
    # the later ones make and free theirs; the step runs after the last; zero_grad frees the gradient.
    assert last_iteration == [
        ("alloc", "activations@0"),
        ("alloc", "temporaries@2"),  # becomes .grad: not freed in this micro-batch
        ("free", "activations@0"),
        ("alloc", "activations@0"),
        ("alloc", "temporaries@2"),
        ("free", "activations@0"),
        ("free", "temporaries@2"),  # added into .grad at node 3
        ("alloc", "activations@0"),
        ("alloc", "temporaries@2"),
        ("free", "activations@0"),
        ("free", "temporaries@2"),
        ("alloc", "temporaries@4"),  # the step
        ("free", "temporaries@4"),
        ("free", "temporaries@2"),  # zero_grad frees the first micro-batch's gradient
    ]
    # Segments (requests over 10 MiB get one of their own size, rounded to 2 MiB): the weights 20;
    # the first micro-batch's activation 40 and its new gradient 20, kept; the next micro-batch's
    # new gradient finds no free 20 MiB (the activation holds the 40) and opens another 20; the
    # step's 2 MiB splits the 40 once the activation is freed. 20 + 40 + 20 + 20.
    assert reserved_peak_bytes(timeline) == 100 * MiB


def test_without_accumulation_the_gradients_are_there_from_the_start() -> None:
    timeline, _, _ = _timeline(micro_batches=1)
    single = MemoryTimeline(  # memplan sets neither flag without accumulation
        5,
        2,
        4,
        tuple(
            TimelineAllocation(a.allocated_at, a.freed_at, a.size_bytes, a.category, a.op, None)
            for a in timeline.allocations
        ),
    )
    assert ("persistent", "gradients@0") in _events(single)


def test_a_traced_accumulating_step_marks_one_new_gradient_per_parameter() -> None:
    spec = resolve_model("tiny-gpt2")
    for grad_accum, loop, expected in (
        (2, "canonical", True),
        (4, "hf-trainer", True),
        (1, "canonical", False),
        (2, "set-to-none-false", False),
    ):
        settings = spec.settings_for(
            TrainingSettings(batch_size=2, seq_len=32, grad_accum=grad_accum, loop=loop, optimizer="sgd", device="cuda")
        )
        timeline = simulate(trace_step(spec, settings)).timeline
        made = [a for a in timeline.allocations if a.made_in_first_micro_batch]
        becomes = [a for a in timeline.allocations if a.becomes_gradient]
        parameters = [a for a in timeline.allocations if a.category == "parameters"]
        if not expected:
            assert not made and not becomes and timeline.micro_batches == 1, (grad_accum, loop)
            continue
        assert timeline.micro_batches == grad_accum
        assert len(made) == len(becomes) == len(parameters)  # every parameter is trained here
        assert sorted(a.size_bytes for a in made) == sorted(a.size_bytes for a in becomes)
        assert all(a.category == "gradients" and a.persists(timeline.node_count) for a in made)
        assert all(timeline.forward_end <= a.allocated_at < timeline.backward_end for a in becomes)


def test_two_micro_batches_and_what_outlives_a_backward() -> None:
    """Two micro-batches (first and last, none between). A tensor made in the forward and read by
    the step (here 1 -> 4) ends with its micro-batch's backward in all but the last."""
    timeline, _, _ = _timeline(micro_batches=2)
    read_by_step = TimelineAllocation(1, 4, 30 * MiB, "activations", "aten.add.Tensor", None)
    timeline = MemoryTimeline(5, 2, 4, (*timeline.allocations, read_by_step), 2)
    events = _events(timeline)
    last_iteration = events[events.index(("alloc", "activations@0")) :]
    assert last_iteration == [
        ("alloc", "activations@0"),
        ("alloc", "activations@1"),
        ("alloc", "temporaries@2"),  # kept: the first micro-batch's new gradient
        ("free", "activations@0"),
        ("free", "activations@1"),  # its backward is over: freed before the next micro-batch
        ("alloc", "activations@0"),
        ("alloc", "activations@1"),
        ("alloc", "temporaries@2"),
        ("free", "activations@0"),
        ("free", "temporaries@2"),
        ("alloc", "temporaries@4"),  # the step, after the last micro-batch
        ("free", "temporaries@4"),
        ("free", "activations@1"),
        ("free", "temporaries@2"),  # zero_grad
    ]
