"""The eager-lifetime tracer hooks every Node of the autograd graph (regression: torch 2.10-2.12).

On those releases a C++ Node's Python wrapper is freed as soon as nothing refers to it, and its
id() is soon another wrapper's: a walk that remembered ids alone skipped most of the graph and
checkpointed predictions came out 2-3.5% high. Counted here against the graph built by hand.
"""

import torch

from memplan.estimator.eager_lifetimes import EagerLifetimes

CHAIN, BRANCH_EVERY = 300, 10


def test_every_node_of_a_branching_graph_is_hooked():
    leaf = torch.ones(4, requires_grad=True)
    x, branches = leaf, []
    for step in range(CHAIN):
        x = x * 1.5  # one MulBackward0 each
        if step % BRANCH_EVERY == 0:
            branches.append(x.exp().sum())  # one ExpBackward0 and one SumBackward0 each
    loss = torch.stack([x.sum(), *branches]).sum()  # SumBackward0, StackBackward0, SumBackward0 (root)
    branch_count = CHAIN // BRANCH_EVERY
    # Every Node but the root: the muls, the branches' exp and sum, x.sum, the stack, AccumulateGrad.
    expected = CHAIN + 2 * branch_count + 1 + 1 + 1

    formulas_returned = []
    lifetimes = EagerLifetimes(lambda: 0)
    lifetimes._formula_returned = lambda grad_inputs, grad_outputs: formulas_returned.append(1)
    lifetimes._hook_graph([loss.grad_fn], running=loss.grad_fn)
    loss.backward()
    assert len(formulas_returned) == expected


def test_before_a_backward_the_roots_are_hooked_too():
    """Hooked before the engine starts (`before_backward`), the root's pre-hook fires before its
    formula: what a tensor pre-hook on the root runs first (FSDP2's unshard, where the loss is
    computed inside the sharded model) is told from the formula."""
    leaf = torch.ones(4, requires_grad=True)
    loss = (leaf * 2.0).sum()  # SumBackward0 (root), MulBackward0, AccumulateGrad
    called, returned = [], []
    lifetimes = EagerLifetimes(lambda: 0)
    lifetimes._formula_called = lambda grad_outputs: called.append(1)
    lifetimes._formula_returned = lambda grad_inputs, grad_outputs: returned.append(1)
    lifetimes.before_backward(loss)
    loss.backward()
    assert (len(called), len(returned)) == (3, 3)


def test_a_step_traced_twice_in_one_process_gives_the_same_peak():
    """FakeTensorMode's op cache rebuilt the LSTM backward's twice-returned bias gradient as two
    tensors on a cache hit (memplan.estimator.fake_mode): the second trace was 1,536 B higher."""
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from memplan.models.source import resolve_model
    from tests.zoo import ZOO_CASES

    case = next(case for case in ZOO_CASES if case.id == "lstm-accum")
    spec = resolve_model(case.model, inputs=case.inputs, loss=case.loss)
    settings = spec.settings_for(case.settings)
    first, second = (simulate(trace_step(spec, settings)) for _ in range(2))
    assert second.peak_bytes == first.peak_bytes
    assert len(second.timeline.allocations) == len(first.timeline.allocations)
