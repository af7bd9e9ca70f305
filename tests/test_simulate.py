"""The liveness simulator on hand-built graphs with hand-computed bytes."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.opgraph import OpGraph, OpNode
from memplan.estimator.recorder import record_graph
from memplan.estimator.simulate import round_for_device, simulate
from memplan.estimator.trace import TracedStep
from memplan.settings import TrainingSettings

FLOAT = 4


def _traced(fn, *shapes, device="cpu", forward_end=None, backward_end=None, backward_node_ops=()) -> TracedStep:
    with FakeTensorMode() as mode:
        inputs = [torch.empty(shape) for shape in shapes]
        graph = record_graph(fn, *inputs)
    del mode
    count = len(graph.nodes)
    return TracedStep(
        graph=graph,
        settings=TrainingSettings(device=device),
        forward_end=forward_end or count,
        backward_end=backward_end or count,
        storage_categories={},
        storage_bytes={},
        node_modules=[None] * count,
        parameter_count=0,
        trainable_parameter_count=0,
        checkpointed_blocks=[],
        python_lifetimes=[],
        backward_node_ops=[list(ops) for ops in backward_node_ops],
        seconds=0.0,
    )


def test_chain_frees_each_temporary_after_its_last_reader():
    # x (persistent input, 100 floats); a = x*2; b = a+1 (a freed); c = b.sum() (b freed)
    def fn(x):
        a = x * 2
        b = a + 1
        return b.sum()

    simulation = simulate(_traced(fn, (100,)))
    # peak at b: x + a + b are live together
    assert simulation.peak_bytes == 3 * 100 * FLOAT
    assert simulation.timeline_bytes[-2] == 100 * FLOAT + FLOAT + 100 * FLOAT  # at sum: x, b, result


def test_an_autograd_formula_keeps_what_it_reads_until_it_returns():
    # Nodes: 0 x, 1 a = x*2, 2 b = a+1, 3 c = b*3, 4 sum, 5 output. Alone, a dies at node 2 and
    # the peak is two 100-float temporaries beside x. As one formula (nodes 2-3), a is held
    # until node 3 returns, so a, b and c are live together with x.
    def fn(x):
        a = x * 2
        b = a + 1
        c = b * 3
        return c.sum()

    assert simulate(_traced(fn, (100,))).peak_bytes == 3 * 100 * FLOAT
    held = simulate(_traced(fn, (100,), backward_node_ops=[(2, 3)]))
    assert held.peak_bytes == 4 * 100 * FLOAT


def test_views_and_in_place_ops_share_their_base_storage():
    def fn(x):
        a = x * 2  # 64 floats
        view = a.view(8, 8)  # no new storage
        view.add_(1)  # in place: no new storage
        t = view.t()  # still the same storage
        return (t * 1).sum()  # a, t*1 live together

    simulation = simulate(_traced(fn, (64,)))
    assert simulation.peak_bytes == 3 * 64 * FLOAT


def test_output_stays_live_to_the_end():
    def fn(x):
        kept = x * 2  # output: never freed
        temp = x + 1
        return [kept, temp.sum()]

    simulation = simulate(_traced(fn, (50,)))
    assert simulation.timeline_bytes[-1] == 2 * 50 * FLOAT + FLOAT


def test_cuda_rounding_to_512_byte_blocks():
    cuda, cpu = TrainingSettings(device="cuda"), TrainingSettings(device="cpu")
    assert round_for_device(1, cuda) == 512
    assert round_for_device(513, cuda) == 1024
    assert round_for_device(0, cuda) == 0
    assert round_for_device(513, cpu) == 513
    # roundup_power2_divisions:4 (CUDACachingAllocator.cpp round_size): 3000 B lies between 2048 and
    # 4096, whose quarters start at 2048, 2560, 3072 and 3584: 3072; 100 MiB + 1 B rounds to 112 MiB.
    divided = TrainingSettings(device="cuda", cuda_alloc_conf="roundup_power2_divisions:4")
    assert round_for_device(3000, divided) == 3072
    assert round_for_device(100 * 2**20 + 1, divided) == 112 * 2**20

    def fn(x):
        return (x + 1).sum()

    # x: 10 floats = 40 B -> 512; x + 1 -> 512; sum -> 4 B -> 512
    assert simulate(_traced(fn, (10,), device="cuda")).peak_bytes == 3 * 512


def test_phase_of_the_peak_follows_the_boundaries():
    def fn(x):
        big = x.repeat(10)
        small = big.sum()
        return small * 2

    # nodes: 0 x, 1 repeat, 2 sum, 3 mul, 4 output; the peak is at sum: x, big and the scalar
    traced = _traced(fn, (100,), forward_end=3, backward_end=4)
    simulation = simulate(traced)
    assert simulation.peak_bytes == 11 * 100 * FLOAT + FLOAT
    assert simulation.peak_node == 2
    assert simulation.phase == "forward"
    assert simulation.phase_peak_bytes["backward"] == 100 * FLOAT + 2 * FLOAT
    assert isinstance(traced.graph, OpGraph)


def test_ops_without_a_fake_value_are_reported_by_name_never_counted_as_zero():
    """A call_function node that returns a tensor but has no fake value (its fake kernel failed) is
    an unsupported op, named as the aten op; an input without one, or an op that returns no
    tensor (a Python number), is not."""

    def fn(x):
        return (x * 2).sum()

    traced = _traced(fn, (100,))
    nodes = traced.graph.nodes
    assert [node.op for node in nodes][:1] == ["placeholder"] and str(nodes[1].target) == "aten.mul.Tensor"
    del nodes[1].meta["val"]
    del nodes[0].meta["val"]
    scalar = OpNode("call_function", torch.ops.aten._local_scalar_dense.default)  # returns a Scalar
    nodes.insert(2, scalar)
    traced.node_modules.append(None)
    simulation = simulate(traced)
    assert simulation.unsupported_ops == ("aten.mul.Tensor",)


def test_the_peak_names_its_op_and_the_timeline_names_each_storages_maker():
    def fn(x):
        big = x.repeat(10)
        return big.sum()

    simulation = simulate(_traced(fn, (100,)))
    assert simulation.peak_op == "aten.sum.default"  # x, big and the sum's scalar live together there
    assert [allocation.op for allocation in simulation.timeline.allocations] == [
        "placeholder",
        "aten.repeat.default",
        "aten.sum.default",
    ]


def test_a_convolutions_workspace_is_capped_in_mib_and_absent_when_it_makes_no_cudnn_call():
    """CUDNN_CONV_WSCAP_DBG (--cudnn-workspace-cap) is in MiB: a 1 MiB cap holds an 8 MiB band top to
    1,048,576 bytes. A backward that only sums the bias's gradient calls no cuDNN convolution."""
    from memplan.estimator.simulate import _conv_workspace

    x = torch.empty(8, 64, 64, 64, dtype=torch.float16, device="meta")  # 4 MiB
    weight = torch.empty(64, 64, 3, 3, dtype=torch.float16, device="meta")
    forward = OpNode("call_function", torch.ops.aten.convolution.default)
    forward.meta["val"] = torch.empty(8, 64, 64, 64, dtype=torch.float16, device="meta")  # 4 MiB
    args = (x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    a100 = TrainingSettings(device="cuda", gpu="A100-40GB")
    uncapped = _conv_workspace(forward, args, a100)
    assert uncapped == (("cudnn workspace (aten.convolution.default)", 8 * 2**20 + 64 * 64 * 9 * 2),)
    capped = _conv_workspace(forward, args, a100.replace(cudnn_workspace_cap_mib=1))
    assert capped == (("cudnn workspace (aten.convolution.default)", 2**20),)
    backward = OpNode("call_function", torch.ops.aten.convolution_backward.default)
    grad = forward.meta["val"]
    bias_only = (grad, x, weight, [64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, False, True])
    assert _conv_workspace(backward, bias_only, a100) == ()
