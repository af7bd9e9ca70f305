"""memplan.estimator.composite_kernels' Slow2d rules: a CPU convolution that oneDNN does not run (oneDNN off, as
tests/hand_measure.py measures, or float64) allocates its im2col columns inside `thnn_conv2d` and again inside
`_slow_conv2d_backward`, and a grouped one each group's input (and grad_output) slices, which no dispatch mode sees.

Truth: the same step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's own events
(tests/hand_measure.py). Before the rules a [2, 8, 16, 16] 3x3 convolution's step was 21,056 B (10.2%) low. From a
batch of 16 a float32 one runs NNPACK (`use_nnpack`), whose backward is SlowDilated2d's with one sample's columns: the
rules had counted nothing there (a ConvNeXt-pattern step 131,104 B low, a grouped 3x3 one 11% low) and Slow2d's
columns for a 1-D one (42% high)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

BATCH = 2
CASES = {
    "3x3": (lambda: nn.Conv2d(8, 16, 3, padding=1), (8, 16, 16), False),
    "3x3-stride-2": (lambda: nn.Conv2d(8, 16, 3, stride=2, padding=1), (8, 16, 16), False),
    "depthwise": (lambda: nn.Conv2d(8, 8, 7, padding=3, groups=8), (8, 16, 16), False),
    "grouped-channels-last": (lambda: nn.Conv2d(8, 16, 5, padding=2, groups=2), (8, 16, 16), True),
    "conv1d": (lambda: nn.Conv1d(8, 16, 9, padding=4), (8, 64), False),
}


class _Convolved(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        make, _, self.channels_last = CASES[case]
        self.conv = make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.conv(x).square().mean()


@pytest.mark.parametrize("batch", [BATCH, 16])  # 16: NNPACK forward, SlowDilated2d backward (where NNPACK is built)
@pytest.mark.parametrize("case", list(CASES))
def test_a_slow_cpu_convolution_holds_its_columns(case, batch):
    shape = CASES[case][1]

    def build():
        torch.manual_seed(0)
        model = _Convolved(case)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        return training_iteration(model, torch.randn(batch, *shape), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)  # oneDNN off: ATen's own backends
    spec = loss_returning_spec(f"conv-{case}", lambda: _Convolved(case), shape)
    settings = TrainingSettings(batch_size=batch, device="cpu", optimizer="sgd")
    with torch.backends.mkldnn.flags(enabled=False):
        assert simulate(trace_step(spec, settings)).peak_bytes == measured
        assert measure_cpu(spec, settings).peak_bytes == measured


def _op_scratch_measured(args: tuple) -> tuple[int, set[str]]:
    """What `aten.convolution` holds beside its output when it runs for real (torch.profiler's memory events), and
    the ops it ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        out = torch.ops.aten.convolution.default(*args)
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak - out.numel() * out.element_size(), {event.name for event in profiler.events()}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built")
def test_a_small_float32_convolution_runs_slow2d_with_onednn_on():
    """oneDNN on (torch's default): a batch of 1, one group, a 3x3 kernel and at most 20,480 input elements take
    THNN's Slow2d (`ConvParams::use_mkldnn`), with its im2col columns; the rule had taken every float32 convolution
    for oneDNN's and counted 0 (72 KiB low here)."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes

    args = (torch.randn(1, 8, 16, 16), torch.randn(8, 8, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    with torch.backends.mkldnn.flags(enabled=True):
        measured, ran = _op_scratch_measured(args)
        predicted = kernel_scratch_bytes(torch.ops.aten.convolution.default, args, {}, "cpu")
    assert "aten::thnn_conv2d" in ran
    assert predicted == measured == 8 * 9 * 256 * 4


def test_one_element_convolution_parameters_stand_for_every_dimension():
    """`aten.convolution` expands a one-element stride, padding or dilation (expand_param_if_needed): the rule reads
    them so, where it had raised an IndexError inside the trace."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes

    full = (torch.randn(1, 8, 16, 16, dtype=torch.float64), torch.randn(8, 8, 3, 3, dtype=torch.float64), None)
    short = (*full, [1], [1], [1], False, [0], 1)
    measured, _ = _op_scratch_measured(short)
    assert kernel_scratch_bytes(torch.ops.aten.convolution.default, short, {}, "cpu") == measured > 0


_NNPACK = pytest.mark.skipif(
    not (torch.backends.nnpack.is_available() and torch._C._get_nnpack_enabled()), reason="no NNPACK on this CPU"
)


@_NNPACK
def test_nnpack_backward_holds_one_samples_columns_and_the_bias_sum():
    """A batch of 16 takes NNPACK (`use_nnpack`, Convolution.cpp) and its backward `slow_conv_dilated2d_backward_cpu`
    (NaiveDilatedConvolution.cpp): one sample's columns, [in_channels * kh * kw, oh * ow], even for a 1x1 kernel, and
    the per-sample `grad_output_n.sum(dims)` for the bias beside them. Hand-computed for the ConvNeXt pattern's 32 to 8
    channel 1x1 convolution over 32x32: 32 * 1024 * 4 + 8 * 4 = 131,104 B, what the CPU allocator's events show."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes
    from tests.hand_measure import held_beside_outputs

    input, weight, bias = torch.randn(16, 32, 32, 32), torch.randn(8, 32, 1, 1), torch.randn(8)
    geometry = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    with torch.backends.mkldnn.flags(enabled=False):
        _, ran = _op_scratch_measured((input, weight, bias, *geometry))
        grad_output = torch.randn(16, 8, 32, 32)
        args = (grad_output, input, weight, [8], *geometry, [True, True, True])
        measured = held_beside_outputs(lambda: torch.ops.aten.convolution_backward.default(*args))
        predicted = kernel_scratch_bytes(torch.ops.aten.convolution_backward.default, args, {}, "cpu")
    assert "aten::_nnpack_spatial_convolution" in ran
    assert predicted == measured == 32 * 1024 * 4 + 8 * 4


# (batch, in, out, kernel, padding, dilation, groups, bias, channels-last input, 1-D, input's gradient wanted)
_NO_GROUP_BACKENDS = {
    "nnpack-3x3-no-bias": (16, 8, 16, 3, 1, 1, 1, False, False, False, True),
    "nnpack-depthwise-7x7": (16, 8, 8, 7, 3, 1, 8, True, False, False, False),
    "nnpack-grouped-channels-last": (16, 8, 16, 5, 2, 1, 2, True, True, False, True),
    "nnpack-conv1d": (16, 8, 16, 9, 4, 1, 1, True, False, True, True),
    "dilated-grouped": (4, 8, 16, 3, 2, 2, 2, True, False, False, True),
    "dilated-channels-last": (4, 8, 16, 3, 2, 2, 1, True, True, False, True),
}


@_NNPACK
@pytest.mark.parametrize("case", list(_NO_GROUP_BACKENDS))
def test_nnpack_and_dilated_convolutions_hold_what_their_kernels_allocate(case):
    """Forward and backward of NnpackSpatial (from a batch of 16) and SlowDilated2d (dilated) as the CPU allocator's
    events show them, beside their outputs: the contiguous copies (NNPACK's in the default format), each group's
    slices and the outputs before the cat, a zero bias NNPACK makes where there is none, the dilated backward's one
    sample's columns and bias sum. The rules had counted 0 for all of them, and Slow2d's whole-batch columns for the
    1-D NNPACK one."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes
    from tests.hand_measure import held_beside_outputs

    batch, c_in, c_out, k, pad, dil, groups, has_bias, channels_last, one_d, input_grad = _NO_GROUP_BACKENDS[case]
    dims = 1 if one_d else 2
    torch.manual_seed(0)
    input = torch.randn(batch, c_in, *([64] if one_d else [32, 32]))
    if channels_last:
        input = input.contiguous(memory_format=torch.channels_last)
    weight, bias = torch.randn(c_out, c_in // groups, *[k] * dims), torch.randn(c_out) if has_bias else None
    geometry = ([1] * dims, [pad] * dims, [dil] * dims, False, [0] * dims, groups)
    forward = (input, weight, bias, *geometry)
    with torch.backends.mkldnn.flags(enabled=False):
        output = torch.ops.aten.convolution.default(*forward)
        backward = (torch.randn_like(output), input, weight, [c_out] if has_bias else None, *geometry)
        backward += ([input_grad, True, has_bias],)
        measured = (
            held_beside_outputs(lambda: torch.ops.aten.convolution.default(*forward)),
            held_beside_outputs(lambda: torch.ops.aten.convolution_backward.default(*backward)),
        )
        predicted = (
            kernel_scratch_bytes(torch.ops.aten.convolution.default, forward, {}, "cpu"),
            kernel_scratch_bytes(torch.ops.aten.convolution_backward.default, backward, {}, "cpu"),
        )
    assert predicted == measured
    assert sum(measured) > 0


@_NNPACK
def test_the_convnext_pattern_step_at_a_batch_of_16_is_exact():
    """benchmarks/cpu_onednn_convolutions.py's step with oneDNN off at a batch of 16, where all three convolutions take
    NNPACK: its peak falls in the 32 to 8 channel 1x1 convolution's backward, which holds one sample's columns and
    the bias's sum (131,104 B the rules had not counted: 9,049,240 B against a measured 9,180,344 B here)."""
    import memplan
    from benchmarks.cpu_onednn_convolutions import measured_step

    model, inputs = "benchmarks.cpu_onednn_convolutions:model", "benchmarks.cpu_onednn_convolutions:inputs"
    with torch.backends.mkldnn.flags(enabled=False):
        predicted = memplan.estimate(model, inputs=inputs, batch_size=16, optimizer="sgd", device="cpu")
    assert predicted.peak_bytes == measured_step(False, 16)


# name: (module, per-sample input shape, memory format the forward makes its input, batch, dtype)
_TRANSPOSED_AND_3D = {
    "transposed-3x3": (lambda: nn.ConvTranspose2d(8, 16, 3, padding=1), (8, 16, 16), None, 2, torch.float32),
    "transposed-grouped": (
        lambda: nn.ConvTranspose2d(8, 16, 3, padding=1, groups=2),
        (8, 16, 16),
        None,
        2,
        torch.float32,
    ),
    "transposed-channels-last": (
        lambda: nn.ConvTranspose2d(8, 16, 3, padding=1),
        (8, 16, 16),
        torch.channels_last,
        3,
        torch.bfloat16,
    ),
    "conv3d": (lambda: nn.Conv3d(4, 8, 3, padding=1), (4, 8, 8, 8), None, 3, torch.float32),
    "conv3d-grouped-strided": (
        lambda: nn.Conv3d(4, 8, 3, stride=2, padding=1, groups=2),
        (4, 8, 8, 8),
        None,
        2,
        torch.float32,
    ),
    "conv3d-dilated": (lambda: nn.Conv3d(4, 8, 3, padding=2, dilation=2), (4, 8, 8, 8), None, 2, torch.float32),
    "conv3d-channels-last": (
        lambda: nn.Conv3d(4, 8, 3, padding=1),
        (4, 8, 8, 8),
        torch.channels_last_3d,
        2,
        torch.bfloat16,
    ),
    "transposed3d-strided": (
        lambda: nn.ConvTranspose3d(4, 8, 4, stride=2, padding=1),
        (4, 8, 8, 8),
        None,
        2,
        torch.float32,
    ),
    # the output kept in the input-sized storage it is made in (empty_like(input), then resize_; a reviewer's find)
    "transposed3d-narrowing": (lambda: nn.ConvTranspose3d(8, 2, 1), (8, 8, 8, 8), None, 2, torch.float32),
    "transposed3d-narrowing-grouped": (
        lambda: nn.ConvTranspose3d(8, 4, 1, groups=2),
        (8, 8, 8, 8),
        None,
        2,
        torch.float32,
    ),
    "transposed3d-grouped-no-bias": (
        lambda: nn.ConvTranspose3d(4, 8, 3, padding=1, groups=2, bias=False),
        (4, 8, 8, 8),
        None,
        3,
        torch.float32,
    ),
}


class _CastAndConvolved(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        make, _, self.memory_format, _, _ = _TRANSPOSED_AND_3D[case]
        self.conv = make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.conv.weight.dtype)
        if self.memory_format is not None:
            x = x.contiguous(memory_format=self.memory_format)
        return self.conv(x).square().mean()


@pytest.mark.parametrize("case", list(_TRANSPOSED_AND_3D))
def test_a_transposed_or_3d_convolution_step_is_exact(case):
    """SlowTranspose2d, Slow3d, SlowDilated3d and SlowTranspose3d (oneDNN off) hold columns inside their kernels too:
    the rules had counted nothing for them, and these steps were 12-63% low (a 3x3x3 Conv3d's 63%, a 3x3
    ConvTranspose2d's 47%)."""
    _, shape, _, batch, dtype = _TRANSPOSED_AND_3D[case]

    def build():
        torch.manual_seed(0)
        model = _CastAndConvolved(case).to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        return training_iteration(model, torch.randn(batch, *shape), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec(f"conv-{case}", lambda: _CastAndConvolved(case), shape)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    settings = TrainingSettings(batch_size=batch, device="cpu", optimizer="sgd", precision=precision)
    with torch.backends.mkldnn.flags(enabled=False):
        assert simulate(trace_step(spec, settings)).peak_bytes == measured


def test_transposed_and_3d_columns_are_the_hand_computed_ones():
    """Each backend's columns, hand-computed from its shapes and checked against the CPU allocator's events (oneDNN
    off): SlowTranspose2d's forward keeps the whole batch's, [batch, out * kh * kw, input area], even for a 1x1 kernel;
    SlowTranspose3d's one sample's and, with a bias, `ones` over the output's area; Slow3d's backward makes the input's
    gradient from the whole batch's `fgrad_input` before the weight's and bias's gradients exist, a 1x1x1 kernel's
    too."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes
    from tests.hand_measure import held_beside_outputs

    convolution, backward = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default

    def conv_args(input: tuple, weight: tuple, bias: int | None, stride: int, padding: int, transposed: bool,
                  groups: int = 1, dtype: torch.dtype = torch.float32) -> tuple:  # fmt: skip
        dims = len(input) - 2
        bias_tensor = torch.randn(bias, dtype=dtype) if bias else None
        geometry = ([stride] * dims, [padding] * dims, [1] * dims, transposed, [0] * dims, groups)
        return (torch.randn(*input, dtype=dtype), torch.randn(*weight, dtype=dtype), bias_tensor, *geometry)

    transposed_1x1 = conv_args((2, 8, 16, 16), (8, 16, 1, 1), None, 1, 0, True)
    transposed_3d = conv_args((2, 4, 8, 8, 8), (4, 8, 3, 3, 3), 8, 1, 1, True)
    conv3d_1x1 = conv_args((2, 4, 8, 8, 8), (8, 4, 1, 1, 1), None, 1, 0, False)
    backward_1x1 = (torch.randn(2, 8, 8, 8, 8), conv3d_1x1[0], conv3d_1x1[1], [8], *conv3d_1x1[3:], [True, True, True])
    transposed_grown = conv_args((2, 3, 8, 8, 8), (3, 1, 1, 1, 1), 1, 2, 1, True, dtype=torch.float64)
    grouped_1x1 = conv_args((3, 6, 8, 8, 8), (6, 3, 1, 1, 1), None, 1, 0, False, groups=2)
    expected = {
        "transposed 1x1": (convolution, transposed_1x1, 2 * 16 * 1 * 256 * 4),
        "transposed 3-D": (convolution, transposed_3d, 8 * 27 * 512 * 4 + 512 * 4),
        # fgrad_input [2, 4, 512] beside the input's gradient alone: less the weight's 128 B and the bias's 32 B
        "3-D backward 1x1x1": (backward, backward_1x1, 2 * 4 * 512 * 4 - 8 * 4 * 4 - 8 * 4),
        # the output grows out of the input-sized storage it is made in: that storage beside it as it is resized
        "transposed 3-D grown": (convolution, transposed_grown, 2 * 3 * 512 * 8),
        # two groups: no view of the input, whole-batch columns over all 6 channels (a reviewer's find)
        "3-D grouped 1x1x1": (convolution, grouped_1x1, 3 * 6 * 1 * 512 * 4),
    }
    with torch.backends.mkldnn.flags(enabled=False):
        for name, (op, args, hand_computed) in expected.items():
            measured = held_beside_outputs(lambda op=op, args=args: op(*args))
            assert (kernel_scratch_bytes(op, args, {}, "cpu"), measured) == (hand_computed, hand_computed), name


def test_a_one_channel_group_of_a_channels_last_tensor_is_read_as_channels_last():
    """`thnn_conv_use_channels_last` reads `suggest_memory_format()`, the strides' order: a group's one-channel slice
    of a channels-last input, contiguous both ways, is channels-last there, and its grad_output slice is not copied
    (memplan had counted a copy, 576 B over on this [2, 2, 6, 6] input's two-group backward; a reviewer's find)."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes
    from tests.hand_measure import held_beside_outputs

    backward = torch.ops.aten.convolution_backward.default
    input = torch.randn(2, 2, 6, 6).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(4, 1, 3, 3)
    geometry = ([1, 1], [1, 1], [1, 1], False, [0, 0], 2)
    with torch.backends.mkldnn.flags(enabled=False):
        grad_output = torch.randn_like(torch.ops.aten.convolution.default(input, weight, None, *geometry))
        args = (grad_output, input, weight, [4], *geometry, [True, True, True])
        measured = held_beside_outputs(lambda: backward(*args))
        assert kernel_scratch_bytes(backward, args, {}, "cpu") == measured


@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
def test_asts_patch_embedding_holds_its_copies_and_columns(layout):
    """AST's patch embedding (transformers' ASTPatchEmbeddings): a 16x16 Conv2d of stride 10 (overlapping patches)
    from 1 to 32 channels over `input_values.unsqueeze(1).transpose(2, 3)`, whose backward receives the gradient of
    `.flatten(2).transpose(1, 2)` as a strided view of the [2, 26, 32] gradient it was sliced from. oneDNN off, Slow2d
    (ConvolutionMM2d.cpp): `convolution_backward` (Convolution.cpp) copies the transposed input contiguous (32,768 B);
    `slow_conv2d_backward_cpu` copies grad_output (`grad_output.contiguous()`, 6,144 B) and holds
    `compute_columns2d`'s [2, 1 * 16 * 16, 2 * 12] columns (49,152 B) for the weight's gradient; the forward, the
    input's copy and its columns. The rules were right here: the AST steps' strict xfails
    (tests/test_models_audio_classification.py) came from a prediction made with oneDNN on, where memplan counts
    nothing inside a convolution oneDNN runs (mkldnn_runs), against a run measured with it off."""
    from memplan.estimator.composite_kernels import kernel_scratch_bytes
    from memplan.estimator.composite_kernels.convolution import mkldnn_runs
    from tests.hand_measure import held_beside_outputs

    convolution, backward = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default
    torch.manual_seed(0)
    input = torch.randn(2, 128, 32).unsqueeze(1).transpose(2, 3)
    if layout == "contiguous":
        input = input.contiguous()
    weight, bias = torch.randn(32, 1, 16, 16), torch.randn(32)
    geometry = ([10, 10], [0, 0], [1, 1], False, [0, 0], 1)
    grad_output = torch.randn(2, 26, 32)[:, 2:].transpose(1, 2).view(2, 32, 2, 12)
    forward_args = (input, weight, bias, *geometry)
    backward_args = (grad_output, input, weight, [32], *geometry, [False, True, True])
    input_copy = 2 * 32 * 128 * 4 if layout == "transposed" else 0
    columns = 2 * 256 * 24 * 4
    hand_computed = (input_copy + columns, input_copy + 2 * 32 * 24 * 4 + columns)
    with torch.backends.mkldnn.flags(enabled=False):
        measured = (
            held_beside_outputs(lambda: convolution(*forward_args)),
            held_beside_outputs(lambda: backward(*backward_args)),
        )
        predicted = (
            kernel_scratch_bytes(convolution, forward_args, {}, "cpu"),
            kernel_scratch_bytes(backward, backward_args, {}, "cpu"),
        )
    assert predicted == measured == hand_computed
    if torch.backends.mkldnn.is_available():  # oneDNN on: its convolution, not modelled (docs/usage.md)
        with torch.backends.mkldnn.flags(enabled=True):
            assert mkldnn_runs(input, weight, [10, 10], [1, 1], 1)
            assert kernel_scratch_bytes(backward, backward_args, {}, "cpu") == 0
