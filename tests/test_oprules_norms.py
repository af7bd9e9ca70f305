"""memplan.estimator.oprules.norms: layer norm's saved mean and rstd, sized as the kernels size them.

Truth: the CPU kernel itself, run on real tensors; for CUDA, layer_norm_kernel.cu's rule written out by hand
(float32 statistics for a 16-bit input), since this machine has no GPU."""

from __future__ import annotations

import pytest
import torch

import memplan
from memplan.estimator.oprules import OUTPUT_BYTES_RULES

LAYER_NORM = torch.ops.aten.native_layer_norm.default
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("input_dtype", "weight_dtype"),
    [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F32), (F16, None), (F16, F16)],
)
def test_on_the_cpu_target_the_statistics_are_the_cpu_kernel_s(input_dtype, weight_dtype):
    x = torch.randn(3, 5, 8).to(input_dtype)
    weight = torch.ones(8, dtype=weight_dtype) if weight_dtype is not None else None
    bias = torch.zeros(8, dtype=weight_dtype) if weight_dtype is not None else None
    real = LAYER_NORM(x, [8], weight, bias, 1e-5)
    rule = OUTPUT_BYTES_RULES[LAYER_NORM]((x, [8], weight, bias, 1e-5), {}, "cpu")
    assert rule == [tensor.untyped_storage().nbytes() for tensor in real]


@pytest.mark.parametrize(
    ("input_dtype", "weight_dtype", "statistic_bytes"),
    [(BF16, BF16, 4), (F16, None, 4), (F16, F32, 4), (F32, F32, 4), (torch.float64, torch.float64, 8)],
)
def test_on_the_cuda_target_a_16_bit_input_has_float32_statistics(input_dtype, weight_dtype, statistic_bytes):
    x = torch.empty(3, 5, 8, dtype=input_dtype)
    weight = torch.empty(8, dtype=weight_dtype) if weight_dtype is not None else None
    rule = OUTPUT_BYTES_RULES[LAYER_NORM]((x, [5, 8], weight, None, 1e-5), {}, "cuda")
    assert rule == [3 * 5 * 8 * x.element_size(), 3 * statistic_bytes, 3 * statistic_bytes]


def test_a_bf16_model_s_norms_on_a_cuda_target_save_float32_statistics():
    """End to end: tiny-gpt2 stored in bf16 on a cuda target, each layer norm's mean and rstd requested as
    batch × sequence float32 values (the fake kernel says bfloat16, half of it)."""
    result = memplan.estimate("tiny-gpt2", batch_size=4, seq_len=64, precision="bf16", gpu="A10G")
    norms = [
        allocation
        for allocation in result.timeline.allocations
        if allocation.op == "aten.native_layer_norm.default" and allocation.size_bytes < 4 * 64 * 2 * 8
    ]
    assert norms and {allocation.requested_bytes or allocation.size_bytes for allocation in norms} == {4 * 64 * 4}


GROUP_NORM, GROUP_NORM_BACKWARD = (
    torch.ops.aten.native_group_norm.default,
    torch.ops.aten.native_group_norm_backward.default,
)
BATCH_NORM = torch.ops.aten.native_batch_norm.default


@pytest.mark.parametrize(
    ("input_dtype", "weight_dtype"), [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F32), (BF16, None)]
)
def test_group_norm_s_statistics_and_input_gradient_have_the_cpu_kernel_s_dtypes(input_dtype, weight_dtype):
    from memplan.estimator.oprules import OUTPUT_DTYPE_RULES

    x, grad = torch.randn(2, 8, 3, 3).to(input_dtype), torch.randn(2, 8, 3, 3).to(input_dtype)
    weight = torch.ones(8, dtype=weight_dtype) if weight_dtype is not None else None
    forward = GROUP_NORM(x, weight, weight, 2, 8, 9, 4, 1e-5)
    ruled = OUTPUT_DTYPE_RULES[GROUP_NORM]((x, weight, weight, 2, 8, 9, 4, 1e-5), {}, "cpu")
    assert [dtype or tensor.dtype for dtype, tensor in zip(ruled, forward, strict=True)] == [t.dtype for t in forward]
    arguments = (grad, x, forward[1], forward[2], weight, 2, 8, 9, 4, [True, weight is not None, weight is not None])
    backward = GROUP_NORM_BACKWARD(*arguments)
    ruled = OUTPUT_DTYPE_RULES[GROUP_NORM_BACKWARD](arguments, {}, "cpu")
    assert ruled[0] == backward[0].dtype


@pytest.mark.parametrize(("input_dtype", "weight_dtype"), [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F32)])
def test_batch_norm_s_saved_statistics_have_the_cpu_kernel_s_dtype(input_dtype, weight_dtype):
    from memplan.estimator.oprules import OUTPUT_DTYPE_RULES

    x = torch.randn(2, 8, 3, 3).to(input_dtype)
    weight, running = torch.ones(8, dtype=weight_dtype), torch.zeros(8, dtype=weight_dtype)
    arguments = (x, weight, weight, running, running.clone().fill_(1), True, 0.1, 1e-5)
    real = BATCH_NORM(*arguments)
    ruled = OUTPUT_DTYPE_RULES[BATCH_NORM](arguments, {}, "cpu")
    assert [dtype or tensor.dtype for dtype, tensor in zip(ruled, real, strict=True)] == [t.dtype for t in real]


NORMS = {
    "group": lambda: torch.nn.GroupNorm(8, 64),
    "batch": lambda: torch.nn.BatchNorm2d(64),
    "instance": lambda: torch.nn.InstanceNorm2d(64, affine=True),
}


def normed_conv(norm: str) -> torch.nn.Module:
    """Conv → norm → ReLU → 1×1 conv: under CPU autocast the norm gets a bfloat16 input and keeps float32 weights,
    the mixed-type kernels whose dtypes torch's fake kernels get wrong."""
    conv = torch.nn.Conv2d(3, 64, 3, padding=1)
    return torch.nn.Sequential(conv, NORMS[norm](), torch.nn.ReLU(), torch.nn.Conv2d(64, 5, 1))


def group_normed() -> torch.nn.Module:
    return normed_conv("group")


def batch_normed() -> torch.nn.Module:
    return normed_conv("batch")


def instance_normed() -> torch.nn.Module:
    return normed_conv("instance")


def images(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 3, 8, 8)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.float().square().mean()


@pytest.mark.parametrize("model", ["group_normed", "batch_normed", "instance_normed"])
def test_a_normed_step_under_cpu_autocast_is_its_real_run(model):
    """Without the rules: the group norm's float32 input gradient and the cast autograd made of it back to bfloat16
    (the real kernel makes neither) put the first step 33,148 B (22%) high; half-sized batch- and instance-norm
    statistics put the others 260 B and 1,028 B low. Truth: the step run for real on the CPU."""
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from memplan.measure.cpu import measure_cpu
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings

    spec = resolve_model(
        f"tests.test_oprules_norms:{model}",
        inputs="tests.test_oprules_norms:images",
        loss="tests.test_oprules_norms:mean_square",
    )
    settings = spec.settings_for(TrainingSettings(batch_size=4, device="cpu", optimizer="sgd", precision="amp-bf16"))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert abs(predicted - measure_cpu(spec, settings).peak_bytes) <= 8


def test_the_norms_input_gradients_are_contiguous_as_the_kernels_make_them():
    """Fed a transposed incoming gradient, the CPU kernels still make the input's gradient contiguous, like the input:
    the rule says so where torch's fake kernels copy the gradient's strides."""
    from memplan.estimator.oprules import real_kernel_outputs

    x, weight = torch.randn(4, 64, 32), torch.ones(32)
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [32], weight, weight, 1e-5)
    grad = torch.randn(4, 32, 64).transpose(1, 2)
    arguments = (grad, x, [32], mean, rstd, weight, weight, [True, True, True])
    real = torch.ops.aten.native_layer_norm_backward.default(*arguments)
    assert real[0].is_contiguous()
    faked = (torch.empty_strided(x.shape, grad.stride()), real[1], real[2])  # the layout the fake kernel gives
    ruled = real_kernel_outputs(torch.ops.aten.native_layer_norm_backward.default, arguments, {}, faked, "cpu")
    assert ruled[0].is_contiguous() and ruled[0].shape == x.shape and ruled[1] is real[1]


class _ChannelsMovedBatchNorm(torch.nn.Module):
    """A (N, L, C) projection moved to (N, C, L) for a BatchNorm1d and back, as sequence models run one: the norm's
    input is neither contiguous nor channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(32, 32) / 8), torch.nn.Parameter(torch.randn(32, 32) / 8)
        self.norm = torch.nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm((x.movedim(1, -1) @ self.w1).movedim(-1, 1)))
        return (h.movedim(1, -1) @ self.w2).movedim(-1, 1).float().square().mean()


def sequences(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 32, 7)


def channels_moved_batch_norm() -> torch.nn.Module:
    return _ChannelsMovedBatchNorm()


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_a_batch_norm_of_a_moved_input_lays_its_output_out_as_the_cpu_kernel_does(precision):
    """batch_norm_cpu makes its output in the input's suggested format, contiguous here, where torch's fake kernel
    kept the input's strides: the `movedim` back then looked contiguous and the matmul after it copied nothing in
    the trace, 3,584 B (fp32) and 1,792 B (amp-bf16) low. Truth: the step run for real, no dispatch mode active,
    measured by the CPU allocator's events."""
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings
    from tests.hand_measure import profiled_third_iteration_peak

    def build():
        torch.manual_seed(0)
        model = _ChannelsMovedBatchNorm()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        batch = sequences(4)
        build.kept = (model, optimizer, batch)

        def iteration() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp-bf16"):
                loss = model(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return iteration

    measured = profiled_third_iteration_peak(build)
    spec = resolve_model(
        "tests.test_oprules_norms:channels_moved_batch_norm", inputs="tests.test_oprules_norms:sequences"
    )
    settings = spec.settings_for(TrainingSettings(batch_size=4, device="cpu", optimizer="sgd", precision=precision))
    assert simulate(trace_step(spec, settings)).peak_bytes == measured


@pytest.mark.parametrize(
    ("op", "input_at"),
    [
        (BATCH_NORM, 0),
        (torch.ops.aten._native_batch_norm_legit.default, 0),
        (torch.ops.aten.native_batch_norm_backward.default, 1),
    ],
)
def test_the_batch_norm_rules_give_the_cpu_kernel_s_layouts(op, input_at):
    """The rule's layout against the CPU kernel's own, for a moved (N, C, L) input, a transposed (N, C, W, H) one, a
    channels-last one, and channels-last ones (2-D and 3-D) sliced along their width, neither contiguous in a format
    (the kernel reads their strides' order: channels-last), with a gradient of the other layout; and a [N, C, 1, 1]
    one with channels-last strides, contiguous in both formats, whose output the kernel makes with the default
    format's strides (the rule's layout had been kept where the fake one was contiguous in it, size-1 dimensions'
    strides aside)."""
    from memplan.estimator.oprules import real_kernel_outputs

    weight, running = torch.ones(8), torch.zeros(8)
    inputs = [
        torch.randn(2, 5, 8).permute(0, 2, 1),
        torch.randn(2, 8, 3, 4).permute(0, 1, 3, 2),
        torch.randn(2, 3, 4, 8).permute(0, 3, 1, 2),
        torch.randn(2, 3, 8, 8).permute(0, 3, 1, 2)[..., ::2],
        torch.randn(2, 3, 4, 8, 8).permute(0, 4, 1, 2, 3)[..., ::2],
        # a pooled [N, C, 1, 1] map with channels-last strides, contiguous in both formats: the kernel's output is
        # the default format's, strides (C, 1, 1, 1) (its format is read from the strides' order downstream)
        torch.empty(2, 8, 1, 1, memory_format=torch.channels_last).normal_(),
        torch.empty(2, 8, 1, 1, 1, memory_format=torch.channels_last_3d).normal_(),
    ]
    backward = op == torch.ops.aten.native_batch_norm_backward.default
    for x in inputs:
        # the backward's gradient: the default layout, and the input's own (randn_like keeps a dense one's strides)
        for grad in (torch.randn(x.shape), torch.randn_like(x)) if backward else (None,):
            if backward:
                _, mean, invstd = BATCH_NORM(x, weight, weight, running, running + 1, True, 0.1, 1e-5)
                arguments = (grad, x, weight, running, running + 1, mean, invstd, True, 1e-5, [True, True, True])
            else:
                arguments = (x, weight, weight, running, running + 1, True, 0.1, 1e-5)
            real = op(*arguments)
            faked = (torch.empty_strided(x.shape, (x if input_at == 0 else arguments[0]).stride()), *real[1:])
            ruled = real_kernel_outputs(op, arguments, {}, faked, "cpu")
            assert ruled[0].shape == real[0].shape and ruled[0].stride() == real[0].stride()


class _PooledBranch(torch.nn.Module):
    """A pyramid pooling branch as UperNet's and BEiT's segmentation heads run one (transformers' upernet/
    modeling_upernet.py, UperNetPyramidPoolingModule) over a backbone's map with channels-last strides (ConvNeXt's
    channels-last LayerNorm, a ViT's tokens reshaped): the map pooled to 1x1, a 1x1 convolution, BatchNorm2d and ReLU,
    upsampled back and concatenated with the map for a 3x3 convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.channels_norm = torch.nn.LayerNorm(8)
        self.branch = torch.nn.Conv2d(8, 8, 1, bias=False)
        self.norm = torch.nn.BatchNorm2d(8)
        self.bottleneck = torch.nn.Conv2d(16, 8, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.channels_norm(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        pooled = torch.relu(self.norm(self.branch(torch.nn.functional.adaptive_avg_pool2d(h, 1))))
        up = torch.nn.functional.interpolate(pooled, size=h.shape[2:], mode="bilinear", align_corners=False)
        return self.bottleneck(torch.cat([h, up], dim=1)).square().mean()


def feature_maps(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 8, 12, 12)


def pooled_branch() -> torch.nn.Module:
    return _PooledBranch()


def test_a_batch_norm_over_a_pooled_map_lays_its_output_out_as_the_cpu_kernel_does():
    """The 1x1 convolution's [N, C, 1, 1] output has channels-last strides in the fake run, contiguous in both
    formats; the CPU batch norm makes its output with the default format's strides, which the rule had left as the fake
    kernel's: the upsampling after it read channels-last from them, and so did the concatenation and the bottleneck
    convolution, whose weight gradient was then copied to the parameter's layout in the trace (a UperNet step 36,864 B,
    a BEiT segmentation step 147,456 B high; here 2,304 B). Truth: the step run for real, no dispatch mode active,
    measured by the CPU allocator's events (oneDNN off)."""
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from memplan.models.source import resolve_model
    from memplan.settings import TrainingSettings
    from tests.hand_measure import profiled_third_iteration_peak, training_iteration

    def build():
        torch.manual_seed(0)
        model = _PooledBranch()
        optimizer = torch.optim.AdamW(model.parameters())
        build.kept = (model, optimizer)
        return training_iteration(model, feature_maps(2), lambda out, _: out, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = resolve_model("tests.test_oprules_norms:pooled_branch", inputs="tests.test_oprules_norms:feature_maps")
    settings = spec.settings_for(TrainingSettings(batch_size=2, device="cpu"))
    with torch.backends.mkldnn.flags(enabled=False):
        assert simulate(trace_step(spec, settings)).peak_bytes == measured
