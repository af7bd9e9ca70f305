"""cuDNN convolution workspaces on the cuda target: the band's rule, and where the simulation puts it.

The truths are byte counts computed here by hand from the convolution's shapes (numel × element
size of each operand), not by memplan's code.
"""

from dataclasses import replace

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
_REST = (None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)  # a forward's bias .. groups: plain, ungrouped


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


def _geometry_call(
    direction: str, read: tuple[int, int], written: int, dtype: torch.dtype, **geometry: int
) -> ConvOperands:
    return ConvOperands(read, written, dtype, False, direction, **geometry)  # type: ignore[arg-type]


def test_a_pointwise_convolution_transforms_its_activations_or_runs_as_a_gemm() -> None:
    MiB = 2**20
    x, y, w = 98 * MiB, 49 * MiB, 2 * MiB  # [64, 512, 28, 28] -> 1024 channels, fp32
    strided = {"pointwise": True, "strided": True, "output_pixels": 14 * 14, "batch": 64, "weight_numel": w // 4}
    assert workspace_band_bytes(_geometry_call("forward", (x, w), y, torch.float32, **strided), A100) == (0, x + y)
    data = _geometry_call("backward-data", (y, w), x, torch.float32, **strided)
    assert workspace_band_bytes(data, A100) == (0, y + x)  # grad_output + grad_input, not the weight
    # An fp32 backward-weight adds split-K room: 16 float32 copies of the weight, at most 8.25 MiB.
    weight = _geometry_call("backward-weight", (x, y), w, torch.float32, **strided)
    split_k_cap = 8 * MiB + 256 * 2**10
    assert workspace_band_bytes(weight, A100) == (0, x + y + split_k_cap)
    assert workspace_band_bytes(weight, H100) == (0, x + y + split_k_cap)
    small = _geometry_call("backward-weight", (x, y), 4096, torch.float32, **{**strided, "weight_numel": 1024})
    assert workspace_band_bytes(small, H100) == (0, x + y + 16 * 4096)
    # 16-bit too: their partial sums are float32 as well (16 float32 copies of 512 x 256: capped).
    half = _geometry_call("backward-weight", (x, y), w, torch.float16, **strided)
    assert workspace_band_bytes(half, H100) == (0, x + y + split_k_cap)
    small_half = _geometry_call("backward-weight", (x, y), 2048, torch.bfloat16, **{**strided, "weight_numel": 1024})
    assert workspace_band_bytes(small_half, H100) == (0, x + y + 16 * 1024 * 4)
    # Stride 1 on a 14x14 map or larger: a GEMM on the NCHW tensors; the weight gradient from one
    # float32 partial per image (64 x 256 x 64 weights x 4 bytes = 4 MiB) ...
    gemm = {"pointwise": True, "strided": False, "output_pixels": 56 * 56, "batch": 64, "weight_numel": 256 * 64}
    assert workspace_band_bytes(_geometry_call("forward", (x, w), y, torch.float32, **gemm), H100) == (0, 0)
    assert workspace_band_bytes(_geometry_call("backward-data", (y, w), x, torch.float32, **gemm), H100) == (0, 0)
    partials = _geometry_call("backward-weight", (x, y), 256 * 64 * 4, torch.float16, **gemm)
    assert workspace_band_bytes(partials, H100) == (0, 4 * MiB)
    # ... unless that is more than the transformed path (a 512x1024 weight at batch 64: 128 MiB > 81.5).
    wide_gemm = {**gemm, "output_pixels": 14 * 14, "weight_numel": 512 * 1024}
    wide = _geometry_call("backward-weight", (49 * MiB, 49 * MiB // 2), 2 * MiB, torch.float32, **wide_gemm)
    assert workspace_band_bytes(wide, H100) == (0, 49 * MiB + 49 * MiB // 2 + split_k_cap)
    # A 7x7 map: transformed.
    late = {**gemm, "output_pixels": 7 * 7}
    assert workspace_band_bytes(_geometry_call("forward", (x, w), y, torch.float32, **late), H100) == (0, x + y)


def test_a_backward_convolution_is_backward_data_then_backward_weight() -> None:
    x = torch.empty(2, 3, 8, 8)  # 384 floats
    weight = torch.empty(5, 3, 3, 3)  # 135
    grad_output = torch.empty(2, 5, 6, 6)  # 360
    forward = conv_calls(
        aten.convolution.default, (x, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), grad_output
    )
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
    # A kx1 kernel is not pointwise: its operands are transformed as a kxk kernel's are.
    tall = torch.empty(5, 3, 7, 1)
    (call,) = conv_calls(aten.convolution.default, (x, tall, None, [1, 1], [3, 0], [1, 1], False, [0, 0], 1), x[:, :1])
    assert not call.pointwise


def test_calls_carry_the_dtype_and_channels_last_when_input_or_weight_is() -> None:
    nchw = torch.empty(2, 3, 8, 8, dtype=torch.bfloat16)
    nhwc = nchw.contiguous(memory_format=torch.channels_last)
    weight = torch.empty(5, 3, 3, 3, dtype=torch.bfloat16)
    weight_nhwc = weight.contiguous(memory_format=torch.channels_last)
    out = torch.empty(2, 5, 6, 6, dtype=torch.bfloat16)
    forward = aten.convolution.default
    assert [c.channels_last for c in conv_calls(forward, (nchw, weight, *_REST), out)] == [False]
    assert [c.channels_last for c in conv_calls(forward, (nhwc, weight, *_REST), out)] == [True]
    assert [c.channels_last for c in conv_calls(forward, (nchw, weight_nhwc, *_REST), out)] == [True]
    # One channel: contiguous both ways, which PyTorch calls contiguous.
    single = torch.empty(2, 1, 8, 8)
    assert [c.channels_last for c in conv_calls(forward, (single, torch.empty(5, 1, 3, 3), *_REST), out)] == [False]
    rest = (None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    for x, w, expected in ((nchw, weight, False), (nhwc, weight, True), (nchw, weight_nhwc, True)):
        calls = conv_calls(aten.convolution_backward.default, (out, x, w, *rest), None)
        assert [(c.dtype, c.channels_last) for c in calls] == [(torch.bfloat16, expected)] * 2
    assert [c.dtype for c in conv_calls(forward, (nchw, weight, *_REST), out)] == [torch.bfloat16]


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
    # The first convolution's 3 input channels are padded to 4 for TF32 tensor cores (x, w1).
    x, w1, y1 = 4 * 4 * 32 * 32 * 4, 16 * 4 * 9 * 4, 4 * 16 * 30 * 30 * 4
    w2, y2 = 8 * 16 * 9 * 4, 4 * 8 * 28 * 28 * 4
    workspaces = [a for a in timeline.allocations if a.op.startswith("cudnn workspace")]
    expected = [
        x + w1 + y1,  # first forward
        y1 + w2 + y2,  # second forward
        y2 + w2 + y1,  # second backward: data (grad_output, weight -> grad_input) ...
        y1 + y2 + w2 + 16 * w2,  # ... then weight (input, grad_output -> grad_weight), with split-K room
        x + y1 + w1 + 8 * 2**20 + 256 * 2**10,  # first backward: weight only, padded: the split-K cap
    ]
    assert [a.size_bytes for a in workspaces] == [-(-size // 512) * 512 for size in expected]
    assert all(a.allocated_at == a.freed_at and a.sequential for a in workspaces)
    for workspace in workspaces:  # requested after the storages the same op made
        same_node = [a for a in timeline.allocations if a.allocated_at == workspace.allocated_at]
        assert all(a.op.startswith("cudnn workspace") for a in same_node[same_node.index(workspace) :])
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
    x, w1, y1 = 4 * 4 * 32 * 32 * 4, 16 * 4 * 9 * 4, 4 * 16 * 30 * 30 * 4  # 3 channels padded to 4
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


def _h100_calls() -> list[tuple[str, list, list, list, list, str, float]]:
    """(direction, input shape, weight shape, stride, padding, dtype, MiB cuDNN requested) for every
    convolution call of the H100 run's ResNet configurations that its trace pins to one request:
    a forward call in a stretch of its own, and a backward's two calls (backward-data in the stretch
    just before, backward-weight in its own). docs/validation/h100/conv-workspaces.json."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "validation" / "h100" / "conv-workspaces.json"
    calls = []
    for rows in json.loads(path.read_text()).values():
        for before, row in zip([None, *rows], rows, strict=False):
            if row["stretch"] != "replace" or len(row["calls"]) != 1 or len(row["measured_bytes"]) != 1:
                continue
            direction, x, w, stride, padding, dtype = row["calls"][0]
            measured = row["measured_bytes"][0] / 2**20
            if direction == "forward":
                calls.append(("forward", x, w, stride, padding, dtype, measured))
                continue
            calls.append(("backward-weight", x, w, stride, padding, dtype, measured))
            if before is not None and before["stretch"] == "insert" and len(before["measured_bytes"]) == 1:
                calls.append(("backward-data", x, w, stride, padding, dtype, before["measured_bytes"][0] / 2**20))
    return calls


def _rule_mib(direction: str, x: list, w: list, stride: list, padding: list, dtype: str) -> float:
    dtype_ = getattr(torch, dtype.removeprefix("torch."))
    inputs = torch.empty(x, dtype=dtype_, device="meta")
    weight = torch.empty(w, dtype=dtype_, device="meta")
    out_hw = [
        (size + 2 * pad - k) // step + 1 for size, pad, k, step in zip(x[2:], padding, w[2:], stride, strict=True)
    ]
    grad_output = torch.empty([x[0], w[0], *out_hw], dtype=dtype_, device="meta")
    if direction == "forward":
        calls = conv_calls(
            aten.convolution.default, (inputs, weight, None, stride, padding, [1, 1], False, [0, 0], 1), grad_output
        )
    else:
        args = (grad_output, inputs, weight, None, stride, padding, [1, 1], False, [0, 0], 1, [True, True, False])
        calls = [c for c in conv_calls(aten.convolution_backward.default, args, None) if c.direction == direction]
    return workspace_band_bytes(calls[0], H100)[1] / 2**20


def h100_rule_agreement() -> dict[str, list]:
    """The rule against the H100 run's own requests, call by call: the calls it gets to the byte, within
    the split-K room (8.25 MiB), and further off above or below; the counts docs/validation.md quotes
    (the command is there)."""
    found: dict[str, list] = {"exact": [], "near": [], "above": [], "below": []}
    for direction, x, w, stride, padding, dtype, measured in _h100_calls():
        predicted = _rule_mib(direction, x, w, stride, padding, dtype)
        call = (direction, tuple(x), tuple(w), dtype, round(predicted, 3), round(measured, 3))
        if abs(predicted - measured) < 0.01 or (measured < 0.01 and predicted == 0):
            found["exact"].append(call)
        elif abs(predicted - measured) <= 8.25:  # within the split-K room: 16 copies is the most a call took
            found["near"].append(call)
        else:
            found["above" if measured > predicted else "below"].append(call)
    return found


def test_workspace_sizes_are_what_cudnn_requested_on_the_h100() -> None:
    """The rule against the H100 run's own requests, call by call (672 calls of four ResNet runs)."""
    found = h100_rule_agreement()
    total = sum(len(calls) for calls in found.values())
    assert total >= 600
    # Forward and backward-data calls to the byte; backward-weight ones mostly within their split-K
    # room under the top (the room is the most any call took, most took less).
    not_weight = [c for calls in found.values() for c in calls if c[0] != "backward-weight"]
    exact = [c for c in found["exact"] if c[0] != "backward-weight"]
    assert len(exact) >= 0.9 * len(not_weight), (len(exact), len(not_weight))
    assert len(found["exact"]) + len(found["near"]) >= 0.98 * total, (found["above"], found["below"])
    # Further off: the 7x7 stem's backward-weight (11-30 MiB more than its operands) and bf16
    # forward, and fp16 1x1 1024->512 at 14x14 (transformed: 36.75 MiB, where memplan has a GEMM);
    # below: plans that transformed less than memplan assumes (the safe side).
    assert len(found["above"]) <= 6, found["above"]


def test_16_bit_backward_weight_requests_on_the_h100_are_within_the_band_top() -> None:
    """16-bit backward-weight calls took split-K room too (k float32 copies of the weight, k up to 13,
    plus a few hundred bytes): every such request of the H100 run is at most the band's top, to a
    512-byte allocator block, the 7x7 stem's too (its 3 input channels padded for tensor cores)."""
    calls = [
        (x, w, stride, padding, dtype, round(measured * 2**20))
        for direction, x, w, stride, padding, dtype, measured in _h100_calls()
        if direction == "backward-weight" and dtype != "torch.float32"
    ]
    assert len(calls) >= 150
    for x, w, stride, padding, dtype, measured in calls:
        top = round(_rule_mib("backward-weight", x, w, stride, padding, dtype) * 2**20)
        assert measured <= top + 512, (x, w, dtype, measured, top)
    # resnet-50 amp-fp16's layer2.0 downsample (1x1, 256 -> 512, stride 2, 56x56 input, batch 64):
    # operands by hand, input 64*256*56*56*2 + grad_output 64*512*28*28*2 = 154,140,672 B; cuDNN asked
    # 155,714,095 (3 float32 copies of the weight + 559 B more), a segment of its own on the H100.
    (downsample,) = [c for c in calls if c[1] == [512, 256, 1, 1] and c[4] == "torch.float16"]
    assert downsample[-1] == 155_714_095
    top = round(_rule_mib("backward-weight", *downsample[:-1]) * 2**20)
    assert 154_140_672 < 155_714_095 <= top == 154_140_672 + 16 * 512 * 256 * 4


def test_unaligned_channels_are_padded_for_tensor_cores_on_the_h100() -> None:
    """cuDNN pads NCHW channels that tensor cores cannot take (fp16/bf16: multiples of 8, TF32: 4; a
    strided fp16 layer of up to 4 channels: 4, NVIDIA's Convolutional Layers User's Guide) in the
    copies it transforms. The H100 run's only such convolution is ResNet's 7x7 stride-2 stem (3 -> 64
    channels, 224x224 -> 112x112): every request it made is at most the band's top (to a 512-byte
    block), the 16-bit forwards to the byte of the padded operands (+16 B, as every forward)."""
    unaligned = [
        (direction, x, w, stride, padding, dtype, round(measured * 2**20))
        for direction, x, w, stride, padding, dtype, measured in _h100_calls()
        if w[0] % 8 or w[1] % 8
    ]
    assert {tuple(c[2]) for c in unaligned} == {(64, 3, 7, 7)} and len(unaligned) == 8
    for direction, x, w, stride, padding, dtype, measured in unaligned:
        top = round(_rule_mib(direction, x, w, stride, padding, dtype) * 2**20)
        assert measured <= top + 512, (direction, x[0], dtype, measured, top)
    requested = {(c[0], c[1][0], c[5]): c[-1] for c in unaligned}
    # By hand: fp16 pads 3 channels to 4, bf16 to 8 (input, weight); the 64-channel output is aligned.
    fp16 = 64 * 4 * 224 * 224 * 2 + 64 * 4 * 49 * 2 + 64 * 64 * 112 * 112 * 2
    assert requested[("forward", 64, "torch.float16")] == fp16 + 16 == 128_475_664
    bf16 = 50 * 8 * 224 * 224 * 2 + 64 * 8 * 49 * 2 + 50 * 64 * 112 * 112 * 2
    assert requested[("forward", 50, "torch.bfloat16")] == bf16 + 16 == 120_472_592
    assert (
        round(_rule_mib("forward", [64, 3, 224, 224], [64, 3, 7, 7], [2, 2], [3, 3], "torch.float16") * 2**20) == fp16
    )
    assert (
        round(_rule_mib("forward", [50, 3, 224, 224], [64, 3, 7, 7], [2, 2], [3, 3], "torch.bfloat16") * 2**20) == bf16
    )
    # fp32 backward-weight: from batch 32 to 64 the request grew by an input of 4 channels, not 3.
    growth = requested[("backward-weight", 64, "torch.float32")] - requested[("backward-weight", 32, "torch.float32")]
    assert growth == 32 * 4 * 224 * 224 * 4 + 32 * 64 * 112 * 112 * 4


def test_the_rule_pads_unaligned_channels_of_transformed_operands() -> None:
    """Hand-computed padded copies: bf16 3x3 5 -> 12 channels pads to 8 -> 16; fp32 (TF32) to 8 -> 12;
    16-bit channels-last runs natively (no copies); a grouped convolution is left unpadded."""
    x = torch.empty(2, 5, 10, 10, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(12, 5, 3, 3, dtype=torch.bfloat16, device="meta")
    out = torch.empty(2, 12, 8, 8, dtype=torch.bfloat16, device="meta")
    (call,) = conv_calls(aten.convolution.default, (x, weight, *_REST), out)
    assert workspace_band_bytes(call, H100) == (0, (2 * 8 * 100 + 16 * 8 * 9 + 2 * 16 * 64) * 2)
    (fp32,) = conv_calls(aten.convolution.default, (x.float(), weight.float(), *_REST), out.float())
    assert workspace_band_bytes(fp32, H100) == (0, (2 * 8 * 100 + 12 * 8 * 9 + 2 * 12 * 64) * 4)
    nhwc = x.contiguous(memory_format=torch.channels_last)
    (native,) = conv_calls(aten.convolution.default, (nhwc, weight, *_REST), out)
    assert workspace_band_bytes(native, H100) == (0, 0)
    grouped_weight = torch.empty(12, 3, 3, 3, dtype=torch.float32, device="meta")  # 2 groups of 3 -> 6
    x6 = torch.empty(2, 6, 10, 10, device="meta")
    rest = (*_REST[:-1], 2)
    (grouped,) = conv_calls(aten.convolution.default, (x6, grouped_weight, *rest), out.float())
    assert workspace_band_bytes(grouped, H100) == (0, (2 * 6 * 100 + 12 * 3 * 9 + 2 * 12 * 64) * 4)


def test_a_backward_convolutions_two_workspaces_are_requested_in_turn() -> None:
    """Backward-data's workspace is freed before backward-weight's is requested (Conv_v8.cpp runs and
    frees each plan's workspace in run_conv_plan), so only the larger is ever live."""
    from memplan.estimator.cuda.allocator import CachingAllocator
    from memplan.estimator.timeline import replay_steady_state

    settings = TrainingSettings(batch_size=4, optimizer="sgd", gpu="A100-40GB")
    timeline = simulate(trace_step(_spec(), settings)).timeline
    by_node: dict[int, list] = {}
    for a in timeline.allocations:
        if a.op.startswith("cudnn workspace"):
            by_node.setdefault(a.allocated_at, []).append(a)
    node, (data, weight) = next((n, pair) for n, pair in by_node.items() if len(pair) == 2)
    events: list[tuple[str, object]] = []
    replay_steady_state(timeline, CachingAllocator(), lambda action, handle, a: events.append((action, a)))
    ours = [(action, a) for action, a in events if a is data or a is weight]
    assert ours == [("alloc", data), ("free", data), ("alloc", weight), ("free", weight)]
    workspaces_at = timeline.category_bytes()["workspaces"]
    no_conv = next(i for i in range(timeline.node_count) if i not in by_node)
    assert workspaces_at[node] - workspaces_at[no_conv] == max(data.size_bytes, weight.size_bytes)


def test_a_workspace_that_does_not_fit_is_gone_without_and_anything_else_runs_out() -> None:
    """On a device too small for a workspace, cuDNN's try_configs moves to a plan that needs none and
    the step goes on (the allocator first releases its cache and retries); a tensor that does not fit
    is still out of memory."""
    import pytest

    from memplan.estimator.cuda.allocator import OutOfMemory
    from memplan.estimator.timeline import MemoryTimeline, TimelineAllocation, device_fit_bytes, reserved_peak_bytes

    MiB = 2**20
    weights = TimelineAllocation(0, 3, 20 * MiB, "parameters", "placeholder", None)
    activation = TimelineAllocation(0, 1, 40 * MiB, "activations", "aten.convolution.default", None)
    workspace = TimelineAllocation(1, 1, 60 * MiB, "workspaces", "cudnn workspace (x)", None, sequential=True)
    gradient = TimelineAllocation(2, 2, 40 * MiB, "temporaries", "aten.convolution_backward.default", None)
    timeline = MemoryTimeline(3, 1, 3, (weights, activation, workspace, gradient))
    assert reserved_peak_bytes(timeline) == 120 * MiB  # unbounded: the workspace opens its own segment
    assert reserved_peak_bytes(timeline, capacity_bytes=100 * MiB) == 60 * MiB  # it goes without
    without_room = replace(activation, size_bytes=90 * MiB)
    # The least device it completes in is below its own allocated peak (120 MiB with the workspace):
    # 60 MiB, where the workspace is gone without, as for the step without workspaces.
    assert device_fit_bytes(timeline) == 60 * MiB
    too_large = replace(timeline, allocations=(weights, without_room, workspace, gradient))
    with pytest.raises(OutOfMemory):
        reserved_peak_bytes(too_large, capacity_bytes=100 * MiB)


def test_a_depthwise_convolution_runs_pytorchs_own_kernel_without_workspace() -> None:
    """Convolution.cpp `_select_conv_backend`: depthwise convolutions (groups == input channels) run
    CudaDepthwise2d, not cuDNN, unless channels-last or fp16 4-d with at least 32 channels, no
    dilation and a square stride (or a height of 1)."""
    forward, backward = aten.convolution.default, aten.convolution_backward.default

    def calls(
        channels: int,
        dtype: torch.dtype,
        groups: int,
        channels_last: bool = False,
        dilation: int = 1,
        stride: tuple[int, int] = (1, 1),
        height: int = 28,
        transposed: bool = False,
        dims: int = 2,
    ) -> int:
        spatial = (28,) if dims == 1 else (height, 28, 28)[:dims]
        x = torch.empty(8, channels, *spatial, dtype=dtype, device="meta")
        weight = torch.empty(channels, channels // groups, *(3,) * dims, dtype=dtype, device="meta")
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
        out = torch.empty(8, channels, *spatial, dtype=dtype, device="meta")
        step, dilate = (list(stride)[:dims] + [1] * (dims - 2))[:dims], [dilation] * dims
        geometry = (step, [dilation] * dims, dilate, transposed, [0] * dims, groups)
        forward_calls = conv_calls(forward, (x, weight, None, *geometry), out)
        backward_calls = conv_calls(backward, (out, x, weight, None, *geometry, [True, True, False]), None)
        return len(forward_calls) + len(backward_calls)

    assert calls(64, torch.float32, groups=64) == 0  # PyTorch's depthwise kernel, forward and backward
    assert calls(64, torch.bfloat16, groups=64) == 0
    assert calls(2, torch.float32, groups=2) == 0  # two channels, two groups: depthwise too
    assert calls(64, torch.float32, groups=64, dims=3) == 0  # CudaDepthwise3d
    assert calls(64, torch.float32, groups=64, dims=3, channels_last=True) == 3  # channels-last-3d: cuDNN
    assert calls(64, torch.float32, groups=1) == 3  # an ordinary convolution: cuDNN, three calls
    assert calls(64, torch.float32, groups=2) == 3  # grouped, not depthwise
    assert calls(64, torch.float32, groups=64, transposed=True) == 3  # transposed: not depthwise
    assert calls(64, torch.float32, groups=64, channels_last=True) == 3  # channels-last: cuDNN
    assert calls(32, torch.float16, groups=32) == 3  # fp16, 32 channels or more: cuDNN may take it
    assert calls(16, torch.float16, groups=16) == 0  # fewer than 32 channels
    assert calls(64, torch.float16, groups=64, dilation=2) == 0  # dilated
    assert calls(64, torch.float16, groups=64, stride=(1, 2)) == 0  # a stride that is not square ...
    assert calls(64, torch.float16, groups=64, stride=(1, 2), height=1) == 3  # ... unless the input is 1-d
    # A 1-d convolution is chosen for as a 2-d one of height 1 (`view1d_as_2d`).
    assert calls(64, torch.float32, groups=64, dims=1) == 0
    assert calls(64, torch.float16, groups=64, dims=1) == 3
    assert calls(16, torch.float16, groups=16, dims=1) == 0
