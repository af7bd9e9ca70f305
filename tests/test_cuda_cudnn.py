"""cuDNN convolution workspaces on the cuda target: the band's rule, and where the simulation puts it.

The truths are byte counts computed here by hand from the convolution's shapes (numel × element
size of each operand), not by memplan's code.
"""

import torch
from torch import nn

from memplan.estimator.cuda.cudnn import ConvOperands, conv_calls, workspace_band_bytes
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings
from tests.module_specs import loss_returning_spec

A100, H100, V100, T4 = (8, 0), (9, 0), (7, 0), (7, 5)
aten = torch.ops.aten


def _call(dtype: torch.dtype, channels_last: bool = False) -> ConvOperands:
    return ConvOperands((1000, 200), 3000, dtype, channels_last)


def test_band_tops_are_the_operands_where_a_tensor_core_path_transforms_them() -> None:
    # fp32 NCHW on Ampere and Hopper: TF32 tensor cores, operands transformed: 1000 + 200 + 3000.
    assert workspace_band_bytes(_call(torch.float32), A100) == (0, 4200)
    assert workspace_band_bytes(_call(torch.float32), H100) == (0, 4200)
    assert workspace_band_bytes(_call(torch.float32, channels_last=True), A100) == (0, 4200)  # tf32 rounding
    # 16-bit NCHW: transformed to NHWC; fp16 from Volta, bf16 from Ampere.
    assert workspace_band_bytes(_call(torch.float16), V100) == (0, 4200)
    assert workspace_band_bytes(_call(torch.bfloat16), A100) == (0, 4200)
    # 16-bit channels-last runs natively: nothing to transform.
    assert workspace_band_bytes(_call(torch.bfloat16, channels_last=True), H100) == (0, 0)
    assert workspace_band_bytes(_call(torch.float16, channels_last=True), T4) == (0, 0)
    # No tensor-core path: fp32 before Ampere, bf16 before Ampere, fp64 anywhere.
    assert workspace_band_bytes(_call(torch.float32), V100) == (0, 0)
    assert workspace_band_bytes(_call(torch.float32), T4) == (0, 0)
    assert workspace_band_bytes(_call(torch.bfloat16), T4) == (0, 0)
    assert workspace_band_bytes(_call(torch.float64), H100) == (0, 0)


def test_a_backward_convolution_is_backward_data_then_backward_weight() -> None:
    x = torch.empty(2, 3, 8, 8)  # 384 floats
    weight = torch.empty(5, 3, 3, 3)  # 135
    grad_output = torch.empty(2, 5, 6, 6)  # 360
    forward = conv_calls(aten.convolution.default, (x, weight, None), grad_output)
    assert [(call.read_bytes, call.written_bytes) for call in forward] == [((384 * 4, 135 * 4), 360 * 4)]
    args = (grad_output, x, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    both = conv_calls(aten.convolution_backward.default, (*args, [True, True, False]), None)
    assert [(call.read_bytes, call.written_bytes) for call in both] == [
        ((360 * 4, 135 * 4), 384 * 4),  # backward-data: grad_output, weight -> grad_input
        ((384 * 4, 360 * 4), 135 * 4),  # backward-weight: input, grad_output -> grad_weight
    ]
    weight_only = conv_calls(aten.convolution_backward.default, (*args, [False, True, True]), None)
    assert [call.written_bytes for call in weight_only] == [135 * 4]  # the first layer: no grad_input
    assert conv_calls(aten.mm.default, (x, weight), None) == []


def test_calls_carry_the_dtype_and_channels_last_when_input_or_weight_is() -> None:
    nchw = torch.empty(2, 3, 8, 8, dtype=torch.bfloat16)
    nhwc = nchw.contiguous(memory_format=torch.channels_last)
    weight = torch.empty(5, 3, 3, 3, dtype=torch.bfloat16)
    weight_nhwc = weight.contiguous(memory_format=torch.channels_last)
    out = torch.empty(2, 5, 6, 6, dtype=torch.bfloat16)
    forward = aten.convolution.default
    assert [c.channels_last for c in conv_calls(forward, (nchw, weight, None), out)] == [False]
    assert [c.channels_last for c in conv_calls(forward, (nhwc, weight, None), out)] == [True]
    assert [c.channels_last for c in conv_calls(forward, (nchw, weight_nhwc, None), out)] == [True]
    # One channel: contiguous both ways, which PyTorch calls contiguous.
    single = torch.empty(2, 1, 8, 8)
    assert [c.channels_last for c in conv_calls(forward, (single, torch.empty(5, 1, 3, 3), None), out)] == [False]
    rest = (None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    for x, w, expected in ((nchw, weight, False), (nhwc, weight, True), (nchw, weight_nhwc, True)):
        calls = conv_calls(aten.convolution_backward.default, (out, x, w, *rest), None)
        assert [(c.dtype, c.channels_last) for c in calls] == [(torch.bfloat16, expected)] * 2
    assert [c.dtype for c in conv_calls(forward, (nchw, weight, None), out)] == [torch.bfloat16]


class _TwoConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, 16, 3, bias=False)
        self.second = nn.Conv2d(16, 8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))).sum()


def _spec() -> ModelSpec:
    return loss_returning_spec("two-convs", _TwoConvs, (3, 32, 32))


def test_each_convolution_requests_its_workspace_after_its_output_and_frees_it_at_once() -> None:
    settings = TrainingSettings(batch_size=4, optimizer="sgd", gpu="A100-40GB")
    simulation = simulate(trace_step(_spec(), settings))
    timeline = simulation.timeline
    x, w1, y1 = 4 * 3 * 32 * 32 * 4, 16 * 3 * 9 * 4, 4 * 16 * 30 * 30 * 4
    w2, y2 = 8 * 16 * 9 * 4, 4 * 8 * 28 * 28 * 4
    workspaces = [a for a in timeline.allocations if a.op.startswith("cudnn workspace")]
    expected = [
        x + w1 + y1,  # first forward
        y1 + w2 + y2,  # second forward
        max(y2 + w2 + y1, y1 + y2 + w2),  # second backward: data, then weight
        x + y1 + w1,  # first backward: weight only (the input needs no gradient)
    ]
    assert [a.size_bytes for a in workspaces] == [-(-size // 512) * 512 for size in expected]
    assert all(a.allocated_at == a.freed_at for a in workspaces)
    for workspace in workspaces:  # requested after the storages the same op made
        same_node = [a for a in timeline.allocations if a.allocated_at == workspace.allocated_at]
        assert same_node[-1] is workspace
    # The band's low end is the same step without them; the top holds them on top of what is live.
    assert simulation.conv_workspace_free_peak_bytes < simulation.peak_bytes
    largest = max(a.size_bytes for a in workspaces)
    assert simulation.peak_bytes - simulation.conv_workspace_free_peak_bytes <= largest
    assert simulation.conv_workspace_free_reserved_peak_bytes <= simulation.reserved_peak_bytes


def test_no_cudnn_workspaces_on_the_cpu_or_where_no_tensor_core_path_applies() -> None:
    for settings in (
        TrainingSettings(batch_size=4, optimizer="sgd", device="cpu"),
        TrainingSettings(batch_size=4, optimizer="sgd", gpu="V100-16GB"),
    ):
        simulation = simulate(trace_step(_spec(), settings))
        assert not [a for a in simulation.timeline.allocations if a.op.startswith("cudnn workspace")]
        assert simulation.conv_workspace_free_reserved_peak_bytes is None


def test_the_users_switches_change_the_band_as_cudnn_would() -> None:
    from memplan.estimator.cuda.cudnn import CudnnSwitches

    no_tf32 = CudnnSwitches(allow_tf32=False)
    # cudnn.allow_tf32 = False: fp32 convolutions have no tensor-core path, so nothing to transform.
    assert workspace_band_bytes(_call(torch.float32), A100, no_tf32) == (0, 0)
    assert workspace_band_bytes(_call(torch.bfloat16), A100, no_tf32) == (0, 4200)  # 16-bit is unaffected
    # CUDNN_CONV_WSCAP_DBG: each call's top is capped, never raised.
    assert workspace_band_bytes(_call(torch.float16), H100, CudnnSwitches(workspace_cap_bytes=1000)) == (0, 1000)
    assert workspace_band_bytes(_call(torch.float16), H100, CudnnSwitches(workspace_cap_bytes=5000)) == (0, 4200)
    assert workspace_band_bytes(_call(torch.float16), H100, CudnnSwitches(workspace_cap_bytes=0)) == (0, 0)


def test_the_simulation_applies_the_cap_and_the_tf32_switch() -> None:
    x, w1, y1 = 4 * 3 * 32 * 32 * 4, 16 * 3 * 9 * 4, 4 * 16 * 30 * 30 * 4
    capped = TrainingSettings(batch_size=4, optimizer="sgd", gpu="A100-40GB", cudnn_workspace_cap_mib=0)
    assert not [a for a in simulate(trace_step(_spec(), capped)).timeline.allocations if "cudnn" in a.op]
    one_mib = TrainingSettings(batch_size=4, optimizer="sgd", gpu="A100-40GB", cudnn_workspace_cap_mib=1)
    workspaces = [a for a in simulate(trace_step(_spec(), one_mib)).timeline.allocations if "cudnn" in a.op]
    assert x + w1 + y1 < 2**20 and workspaces[0].requested_bytes == x + w1 + y1  # under the cap: unchanged
    assert max(a.requested_bytes for a in workspaces) <= 2**20
    no_tf32 = TrainingSettings(batch_size=4, optimizer="sgd", gpu="A100-40GB", cudnn_allow_tf32=False)
    simulation = simulate(trace_step(_spec(), no_tf32))
    assert not [a for a in simulation.timeline.allocations if "cudnn" in a.op]
    assert simulation.conv_workspace_free_peak_bytes is None
