"""The liveness simulator on hand-built graphs with hand-computed bytes."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.liveness import round_for_device
from memplan.estimator.opgraph import OpGraph, OpNode
from memplan.estimator.recorder import record_graph
from memplan.estimator.simulate import simulate
from memplan.estimator.traced_step import TracedStep
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
    # A Node whose formula ran no op before it ends nothing for the formulas after it.
    assert simulate(_traced(fn, (100,), backward_node_ops=[(), (2, 3)])).peak_bytes == 4 * 100 * FLOAT


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
    from memplan.estimator.transients import _conv_workspace

    x = torch.empty(8, 64, 64, 64, dtype=torch.float16, device="meta")  # 4 MiB
    weight = torch.empty(64, 64, 3, 3, dtype=torch.float16, device="meta")
    forward = OpNode("call_function", torch.ops.aten.convolution.default)
    forward.meta["val"] = torch.empty(8, 64, 64, 64, dtype=torch.float16, device="meta")  # 4 MiB
    args = (x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    a100 = TrainingSettings(device="cuda", gpu="A100-40GB")
    uncapped = _conv_workspace(forward, args, a100)
    assert [(r.name, r.nbytes) for r in uncapped] == [
        ("cudnn workspace (aten.convolution.default)", 8 * 2**20 + 64 * 64 * 9 * 2)
    ]
    capped = _conv_workspace(forward, args, a100.replace(cudnn_workspace_cap_mib=1))
    assert [(r.name, r.nbytes) for r in capped] == [("cudnn workspace (aten.convolution.default)", 2**20)]
    backward = OpNode("call_function", torch.ops.aten.convolution_backward.default)
    grad = forward.meta["val"]
    bias_only = (grad, x, weight, [64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, False, True])
    assert _conv_workspace(backward, bias_only, a100) == ()


def test_an_output_bytes_rule_sizes_its_ops_storage_from_the_fake_arguments(monkeypatch):
    """An op whose fake kernel gets its output's size wrong has a rule (memplan.estimator.oprules):
    it receives the node's arguments with recorded tensors replaced by their fake values (in
    kwargs too) and plain values as they are, and the target device, and its bytes are the storage's."""
    from memplan.estimator.oprules import OUTPUT_BYTES_RULES

    seen = []

    def rule(args, kwargs, device):
        seen.append((args[0], args[1], sorted(kwargs), kwargs.get("other"), device))
        return [12_345]

    monkeypatch.setitem(OUTPUT_BYTES_RULES, torch.ops.aten.mul.Tensor, rule)

    def fn(x):
        doubled = x * 2
        doubled.add_(1)  # in place: the same storage, which the fake tensor says is 400 B
        return doubled.sum()

    traced = _traced(fn, (100,))
    traced.graph.nodes[1].kwargs = {"other": traced.graph.nodes[0]}
    simulation = simulate(traced)
    x_value = traced.graph.nodes[0].meta["val"]
    assert seen[0][0] is x_value and seen[0][1] == 2
    assert seen[0][2] == ["other"] and seen[0][3] is x_value and seen[0][4] == traced.settings.device
    # x (400 B) and the rule's 12,345 B (the largest any node says of that storage), then the sum's 4 B.
    assert simulation.peak_bytes == 100 * FLOAT + 12_345 + FLOAT
    assert simulation.timeline.allocations[1].requested_bytes == 12_345


def test_a_sparse_output_is_reported_and_the_strided_ones_beside_it_still_counted():
    def fn(x):
        return (x * 2).sum()

    traced = _traced(fn, (100,))
    with FakeTensorMode():
        sparse = torch.empty(10, 10).to_sparse()
        strided = torch.empty(50)
    traced.graph.nodes[1].meta["val"] = (sparse, strided)
    simulation = simulate(traced)
    assert simulation.unsupported_ops == ("aten.mul.Tensor (torch.sparse_coo)",)
    assert simulation.peak_bytes == 100 * FLOAT + 50 * FLOAT + FLOAT  # x, the strided output, the sum


def test_the_node_at_backward_end_is_the_optimizers():
    def fn(x):
        big = x.repeat(10)
        return big.sum()

    # nodes: 0 x, 1 repeat, 2 sum, 3 output; the peak (x, big and the sum) is node 2 = backward_end
    simulation = simulate(_traced(fn, (100,), forward_end=1, backward_end=2))
    assert simulation.peak_node == 2
    assert simulation.phase == "optimizer"
    assert simulation.phase_peak_bytes["backward"] == 11 * 100 * FLOAT


def test_an_empty_storage_takes_no_block_on_cuda():
    def fn(x):
        empty = x.new_empty(0)
        return [x + 1, empty]

    # x and x + 1, 512 B each; the empty tensor asks for nothing (round_size(0) is not called).
    assert simulate(_traced(fn, (10,), device="cuda")).peak_bytes == 2 * 512


def test_state_the_graph_never_reads_and_gradients_released_early_count_from_the_first_node():
    """A parameter no op reads (storage_bytes, never in the graph) is live through the iteration; the
    previous step's gradients under --loop zero-grad-before-backward (released_early) from the first
    node until their release."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def fn(x):
        a = x * 2
        return (a + 1).sum()

    # nodes: 0 x, 1 a, 2 a + 1, 3 sum, 4 output
    unread, old_gradient = torch.empty(250), torch.empty(500)  # 1,000 and 2,000 B, kept alive here
    traced = _traced(fn, (100,))
    traced.storage_bytes[StorageWeakRef(unread.untyped_storage())] = 1_000
    traced.released_early = ((StorageWeakRef(old_gradient.untyped_storage()), 2_000, 1),)
    plain = simulate(_traced(fn, (100,))).timeline_bytes
    timeline = simulate(traced).timeline_bytes
    assert [with_state - without for with_state, without in zip(timeline, plain, strict=True)] == [
        3_000,
        3_000,
        1_000,
        1_000,
        1_000,
    ]


def test_outputs_live_until_the_iteration_ends_after_the_last_node():
    def fn(x):
        kept = x * 2
        return [kept, (x + 1).sum()]

    traced = _traced(fn, (50,))
    end = len(traced.graph.nodes)
    kept = simulate(traced).timeline.allocations[1]
    assert (kept.op, kept.freed_at) == ("aten.mul.Tensor", end)  # gradients: freed by zero_grad, after the graph
    traced.graph.nodes.pop()  # no output node: nothing is kept past its last reader
    traced.node_modules.pop()
    last = simulate(traced).timeline.allocations
    assert [(allocation.op, allocation.freed_at) for allocation in last[1:]] == [
        ("aten.mul.Tensor", 1),
        ("aten.add.Tensor", 3),
        ("aten.sum.default", 3),
    ]


def test_one_cublas_workspace_per_thread_that_multiplies_matrices():
    """CublasHandlePool.cpp: ":4096:8" (32 MiB) on sm90, ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB)
    elsewhere, one per thread; the autograd engine's device thread runs the backward. Rounded as
    the allocator rounds: roundup_power2_divisions:4 takes 8.125 MiB to 10 MiB."""
    from memplan.estimator.transients import cublas_workspaces

    def fn(x):
        y = x @ x
        return (y @ x).sum()

    # nodes: 0 x, 1 mm, 2 mm, 3 sum, 4 output
    forward_only = _traced(fn, (64, 64), device="cuda")
    forward_only.settings = TrainingSettings(device="cuda", gpu="H100-80GB")
    assert cublas_workspaces(forward_only) == [32 * 2**20]
    both = _traced(fn, (64, 64), device="cuda", forward_end=2, backward_end=3)
    both.settings = TrainingSettings(device="cuda", gpu="A100-40GB", cuda_alloc_conf="roundup_power2_divisions:4")
    assert cublas_workspaces(both) == [10 * 2**20, 10 * 2**20]
    both.settings = TrainingSettings(device="cuda", gpu="A100-40GB")
    assert cublas_workspaces(both) == [2 * 4 * 2**20 + 8 * 16 * 2**10] * 2
    both.settings = TrainingSettings(device="cuda", gpu="A100-40GB", cublas_workspace_config=":16:8")
    assert cublas_workspaces(both) == [8 * 16 * 2**10] * 2  # CUBLAS_WORKSPACE_CONFIG=:16:8: 8 x 16 KiB
    assert cublas_workspaces(_traced(fn, (64, 64))) == []  # the CPU has none


def test_each_cublas_workspace_is_made_at_its_threads_first_matmul():
    """The handle and its workspace come with a thread's first cuBLAS call (getCurrentCUDABlasHandle):
    the timeline marks each workspace with that node, for the first iteration to request it there."""
    from memplan.estimator.transients import first_matmuls

    def fn(x):
        y = x @ x
        return (y @ x).sum()

    # nodes: 0 x, 1 mm, 2 mm, 3 sum, 4 output
    both = _traced(fn, (64, 64), device="cuda", forward_end=2, backward_end=3)
    both.settings = TrainingSettings(device="cuda", gpu="H100-80GB")
    assert first_matmuls(both) == [1, 2]  # the forward's mm at node 1, the backward's at node 2
    workspaces = [a for a in simulate(both).timeline.allocations if a.op == "cublas workspace"]
    assert [(a.first_used_at, a.allocated_at, a.freed_at) for a in workspaces] == [(1, 0, 5), (2, 0, 5)]
    # A main thread whose only matmul is in the optimizer step (node 2) makes its workspace there.
    late = _traced(fn, (64, 64), device="cuda", forward_end=1, backward_end=2)
    late.settings = TrainingSettings(device="cuda", gpu="H100-80GB")
    assert first_matmuls(late) == [2, 1]


def test_a_peak_with_nothing_live_is_zero_and_a_phase_without_nodes_peaks_at_zero():
    simulation = simulate(_traced(lambda x: [x], (0,)))  # one empty input: nothing is ever live
    assert simulation.peak_bytes == 0
    assert simulation.phase_peak_bytes == {"forward": 0, "backward": 0, "optimizer": 0}


def test_the_first_of_two_equal_peaks_is_the_peak():
    def fn(x):
        a = x * 2
        b = a + 1  # x, a, b
        c = b * 3  # x, b, c: as many bytes
        return c.sum()

    simulation = simulate(_traced(fn, (100,)))
    assert simulation.timeline_bytes[2] == simulation.timeline_bytes[3] == simulation.peak_bytes
    assert simulation.peak_node == 2


def test_the_breakdown_reads_the_storages_categories_and_names_the_peaks_module():
    from torch.multiprocessing.reductions import StorageWeakRef

    def fn(x):
        a = x * 2
        return (a + 1).sum()

    traced = _traced(fn, (100,))
    x = traced.graph.nodes[0].meta["val"]
    traced.storage_categories[StorageWeakRef(x.untyped_storage())] = "inputs"
    traced.node_modules[:] = [None, "encoder", "encoder.head", "encoder.head", None]
    simulation = simulate(traced)
    assert simulation.breakdown["inputs"] == 100 * FLOAT
    assert simulation.breakdown["temporaries"] == 2 * 100 * FLOAT  # a and a + 1 at the peak (node 2)
    assert simulation.peak_module == "encoder.head"
    # the same peak node counted as the backward's: no module named (a recomputation's may linger on later ops)
    traced.forward_end = 2
    assert simulate(traced).phase == "backward" and simulate(traced).peak_module is None
    assert [allocation.module for allocation in simulation.timeline.allocations] == [
        None,
        "encoder",
        "encoder.head",
        "encoder.head",
    ]


def test_the_reserved_peak_follows_the_allocator_configuration():
    """A 40 MiB tensor freed, then a 15 MiB one: by default the 15 MiB request splits the cached
    40 MiB block (reserved 40 MiB, besides the 2 MiB small-pool segment of the scalars); with
    max_split_size_mb:20 the 40 MiB block is oversize and serves no request below 20 MiB, so a
    16 MiB segment is added (CUDACachingAllocator.cpp get_free_block)."""

    def fn(x):
        big = x.new_zeros(10 * 2**20)
        total = big.sum()
        later = x.new_zeros(15 * 2**18)
        return [total, later.sum()]

    plain = simulate(_traced(fn, (10,), device="cuda"))
    traced = _traced(fn, (10,), device="cuda")
    traced.settings = TrainingSettings(device="cuda", cuda_alloc_conf="max_split_size_mb:20")
    capped = simulate(traced)
    assert plain.reserved_peak_bytes == 42 * 2**20
    assert capped.reserved_peak_bytes == 58 * 2**20


def test_cublas_workspaces_open_the_timeline_for_the_whole_iteration():
    def fn(x):
        return (x @ x).sum()

    traced = _traced(fn, (64, 64), device="cuda")
    traced.settings = TrainingSettings(device="cuda", gpu="H100-80GB")
    simulation = simulate(traced)
    first = simulation.timeline.allocations[0]
    assert (first.op, first.allocated_at, first.freed_at, first.size_bytes) == (
        "cublas workspace",
        0,
        len(traced.graph.nodes),
        32 * 2**20,
    )
    assert simulation.breakdown["workspaces"] == 32 * 2**20


class _ConvAttention(torch.nn.Module):
    """A convolution whose output becomes the tokens of one self-attention: both kinds of CUDA
    kernel transients (a cuDNN workspace band, the attention backward's scratch) in one step."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(64, 256, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.avg_pool2d(self.conv(x), 8)
        tokens = pooled.flatten(2).transpose(1, 2).contiguous()  # [batch, 64 positions, 256 channels]
        q = tokens.reshape(tokens.shape[0], 64, 4, 64).transpose(1, 2)
        attended = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return attended.float().sum()


def _conv_attention_spec():  # type: ignore[no-untyped-def]
    from memplan.models.objects import object_spec  # the notebook API's: a model class and a batch function

    return object_spec(_ConvAttention, lambda batch_size: torch.randn(batch_size, 64, 64, 64), None)


# Workspaces capped at 16 MiB (CUDNN_CONV_WSCAP_DBG): with the full top (the backward-weight's split-K room) the
# conv+attention step's band is not inverted.
CONV_ATTENTION_SETTINGS = TrainingSettings(
    batch_size=4,
    optimizer="sgd",
    precision="amp-bf16",
    gpu="A100-40GB",
    cuda_alloc_conf="max_split_size_mb:20",
    cudnn_workspace_cap_mib=16,
)


def test_the_conv_workspace_free_end_is_the_step_with_every_workspace_capped_at_zero():
    """The band's low end (every cuDNN workspace 0 bytes) is the same step run with
    CUDNN_CONV_WSCAP_DBG=0, which leaves cuDNN no workspace; the attention backward's scratch stays
    in both, and both ends read the allocator configuration (max_split_size_mb here). The high end
    is above the low one, at a convolution, and its breakdown adds up to its peak."""
    from memplan.estimator.trace import trace_step

    spec, settings = _conv_attention_spec(), CONV_ATTENTION_SETTINGS
    band = simulate(trace_step(spec, settings))
    no_workspace = simulate(trace_step(spec, settings.replace(cudnn_workspace_cap_mib=0)))
    scratch = [a for a in band.timeline.allocations if "attention backward scratch" in a.op]
    assert scratch and band.conv_workspace_free_peak_bytes is not None
    assert band.conv_workspace_free_peak_bytes == no_workspace.peak_bytes
    assert band.conv_workspace_free_reserved_peak_bytes == no_workspace.reserved_peak_bytes
    assert band.peak_bytes > no_workspace.peak_bytes
    assert band.peak_op.startswith("aten.convolution")
    assert sum(band.breakdown.values()) == band.peak_bytes
    assert sum(no_workspace.breakdown.values()) == no_workspace.peak_bytes


def test_activations_are_made_in_the_forward_and_read_in_the_backward():
    """Saved for backward: made before the first backward node, read at it or after, and not kept
    to the iteration's end (outputs are not activations)."""

    def fn(x):
        kept = x - 1  # an output: to the end
        a = x * 2  # read by the first backward node
        b = a + 1  # made at the first backward node
        c = b * 3
        return [c.sum(), kept]

    # nodes: 0 x, 1 kept, 2 a, 3 b, 4 c, 5 sum, 6 output; the backward starts at node 3
    simulation = simulate(_traced(fn, (100,), forward_end=3, backward_end=6))
    categories = [(allocation.op, allocation.category) for allocation in simulation.timeline.allocations]
    assert categories == [
        ("placeholder", "temporaries"),
        ("aten.sub.Tensor", "temporaries"),
        ("aten.mul.Tensor", "activations"),
        ("aten.add.Tensor", "temporaries"),
        ("aten.mul.Tensor", "temporaries"),
        ("aten.sum.default", "temporaries"),
    ]


def test_a_budget_must_hold_what_the_step_completes_in_at_both_ends_of_the_workspace_band():
    """Without workspaces the allocator's segments can fall so that more is reserved: under
    max_split_size_mb:20 the conv+attention step reserves more with no workspace than with the
    largest. What a budget must hold (fit_bytes) is the least device memory in which the step
    completes, whichever end cuDNN's plans fall at, with the allocator releasing cached segments
    and retrying when short: checked by replaying both ends under that capacity and 2 MiB less,
    for traced steps and for the batch search's timelines alike (interpolate.fit_bytes)."""
    from memplan.estimator.interpolate import fit_bytes
    from memplan.estimator.timeline import completes_within, without_cudnn_workspaces
    from memplan.estimator.trace import trace_step

    spec, settings = _conv_attention_spec(), CONV_ATTENTION_SETTINGS
    band = simulate(trace_step(spec, settings))
    top, none = band.reserved_peak_bytes, band.conv_workspace_free_reserved_peak_bytes
    no_workspace = simulate(trace_step(spec, settings.replace(cudnn_workspace_cap_mib=0)))
    assert none == no_workspace.reserved_peak_bytes > top  # this step's band is inverted
    for step_settings in (settings, settings.replace(cuda_alloc_conf=None)):
        step = band if step_settings is settings else simulate(trace_step(spec, step_settings))
        config, fit = step_settings.allocator_config, step.fit_bytes
        ends = (step.timeline, without_cudnn_workspaces(step.timeline))
        assert all(completes_within(end, fit, config) for end in ends)
        assert not all(completes_within(end, fit - (2 << 20), config) for end in ends)
        assert fit < step.reserved_peak_bytes  # the retry completes below the unconstrained peak
        assert step.fit_phase_peaks == {"device": fit} and step.smallest_device_bytes == fit
        assert fit_bytes(step.timeline, step_settings) == fit
