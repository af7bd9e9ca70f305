"""What CUDA's layer norm and softmax make inside themselves of inputs that are not contiguous, and the partial
sums a tall layer norm backward reduces in: none of which a dispatch mode sees.

The byte counts are written out by hand from aten/src/ATen/native/cuda/layer_norm_kernel.cu (torch 2.11-2.14):
`layer_norm_cuda` / `layer_norm_backward_cuda` begin `input.expect_contiguous()`, `weight.expect_contiguous()`,
`bias.expect_contiguous()`; LayerNormBackwardKernelImpl runs on `dY.contiguous()`; LaunchGammaBetaBackwardCUDAKernel
allocates `dgamma_blocks`/`dbeta_blocks` of [min(32768 / ceil(N / 32), ceil(M / 32)), N] in the weight's dtype
where `M > 64 * 1024 && N / 32 < sm_count / 2`, then `*dgamma = dgamma_blocks.sum(0)`; and from cuda/SoftMax.cu
`host_softmax`: `auto input = input_.contiguous();`. Not computed by memplan on both sides.
"""

from __future__ import annotations

import torch
from torch import nn

from memplan.estimator.composite_kernels import kernel_scratch_requests
from memplan.estimator.cuda.layer_norm_backward import gamma_beta_partials, partial_rows
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.module_specs import loss_returning_spec

LAYER_NORM = torch.ops.aten.native_layer_norm.default
LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
H100_SMS = 132


def _nhwc_view(n: int, c: int, h: int, w: int) -> torch.Tensor:
    """ConvNeXt's `x.permute(0, 2, 3, 1)` of an NCHW activation: [n, h, w, c], not contiguous."""
    return torch.empty(n, c, h, w).permute(0, 2, 3, 1)


def test_layer_norm_forward_copies_a_permuted_input_on_cuda() -> None:
    x, weight, bias = _nhwc_view(2, 8, 4, 4), torch.empty(8), torch.empty(8)
    # one float32 copy of [2, 4, 4, 8]: 2 * 4 * 4 * 8 * 4 = 1,024 B
    assert kernel_scratch_requests(LAYER_NORM, (x, [8], weight, bias, 1e-5), {}, "cuda") == (1024,)
    # a contiguous input and parameters: no copy
    assert kernel_scratch_requests(LAYER_NORM, (x.contiguous(), [8], weight, bias, 1e-5), {}, "cuda") == ()
    # a strided weight is copied too (expect_contiguous of each): 8 * 4 = 32 B, its own request
    strided_weight = torch.empty(16)[::2]
    assert kernel_scratch_requests(LAYER_NORM, (x, [8], strided_weight, bias, 1e-5), {}, "cuda") == (1024, 32)


def test_layer_norm_backward_copies_input_and_gradient_on_cuda() -> None:
    x, weight, bias = _nhwc_view(2, 8, 4, 4), torch.empty(8), torch.empty(8)
    mean = rstd = torch.empty(2, 4, 4, 1)
    grad = torch.empty(2, 4, 4, 8)
    args = (grad, x, [8], mean, rstd, weight, bias, [True, True, True])
    # X's copy (expect_contiguous), 1,024 B; a contiguous dY is not copied; no per-thread buffer as on the CPU
    assert kernel_scratch_requests(LAYER_NORM_BACKWARD, args, {}, "cuda") == (1024,)
    transposed_grad = torch.empty(2, 8, 4, 4).permute(0, 2, 3, 1)
    args = (transposed_grad, x, [8], mean, rstd, weight, bias, [True, True, True])
    assert kernel_scratch_requests(LAYER_NORM_BACKWARD, args, {}, "cuda") == (1024, 1024)  # X's, then dY's


def test_softmax_forward_copies_a_transposed_input_on_cuda() -> None:
    scores = torch.empty(4, 64, 32).transpose(1, 2)  # softmax over a tensor that is not contiguous
    # host_softmax's `input_.contiguous()`: 4 * 32 * 64 * 4 = 32,768 B
    assert kernel_scratch_requests(torch.ops.aten._softmax.default, (scores, -1, False), {}, "cuda") == (32768,)
    assert kernel_scratch_requests(torch.ops.aten._log_softmax.default, (scores, 1, False), {}, "cuda") == (32768,)
    assert kernel_scratch_requests(torch.ops.aten._softmax.default, (scores.contiguous(), -1, False), {}, "cuda") == ()


def test_tall_layer_norm_backward_partial_buffers() -> None:
    # ConvNeXt-T stage 1 at batch 32: M = 32 * 56 * 56 = 100,352 rows of N = 96 channels. blocks.x = ceil(96 / 32)
    # = 3; blocks.y = min(32768 // 3 = 10,922, ceil(100,352 / 32) = 3,136) = 3,136 rows of partial sums.
    assert partial_rows(100_352, 96, H100_SMS) == 3136
    calls = gamma_beta_partials(torch.empty(32, 56, 56, 96), [96], torch.empty(96), torch.empty(96), [1, 1, 1], 132)
    # dgamma_blocks and dbeta_blocks, 3,136 x 96 float32 = 1,204,224 B each, and one [96] sum result, 384 B
    assert [call.bytes() for call in calls] == [1_204_224, 1_204_224, 384]
    # only the weight's gradient asked for: no dbeta_blocks
    calls = gamma_beta_partials(torch.empty(32, 56, 56, 96), [96], torch.empty(96), torch.empty(96), [1, 1, 0], 132)
    assert [call.bytes() for call in calls] == [1_204_224, 0, 384]
    # `M > 64 * 1024`: 65,536 rows take the column kernels
    assert partial_rows(65_536, 96, H100_SMS) == 0
    assert partial_rows(65_537, 96, H100_SMS) == (65_537 + 31) // 32
    # `N / 32 < sm_count / 2`: 2,111 // 32 = 65 < 66 runs it (blocks.x = 66: 32768 // 66 = 496 rows at most)
    assert partial_rows(1_000_000, 2_111, H100_SMS) == 496
    assert partial_rows(1_000_000, 2_112, H100_SMS) == 0  # 66, not below 66
    # an A100's 108 SMs: 54 is the bound, so 1,728 columns (54) do not
    assert partial_rows(1_000_000, 1_728, 108) == 0
    assert partial_rows(1_000_000, 1_727, 108) == 32768 // 54


class _NHWCNorm(nn.Module):
    """ConvNeXt's block head: a channels-first activation permuted to NHWC and layer-normed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(8, 8, 1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).permute(0, 2, 3, 1)).square().sum()


def test_the_cuda_target_requests_layer_norm_copies_of_a_permuted_activation() -> None:
    spec = loss_returning_spec("nhwc-norm", _NHWCNorm, (8, 16, 16))
    settings = TrainingSettings(batch_size=4, optimizer="sgd", gpu="H100-80GB")
    simulation = simulate(trace_step(spec, settings))
    copy = 4 * 16 * 16 * 8 * 4  # float32 [4, 16, 16, 8]: 32,768 B, in the forward and again in the backward
    own = "aten.native_layer_norm{}.default's own temporaries"
    forward = [a for a in simulation.timeline.allocations if a.op == own.format("")]
    backward = [a for a in simulation.timeline.allocations if a.op == own.format("_backward")]
    assert [a.requested_bytes or a.size_bytes for a in forward] == [copy]
    assert [a.requested_bytes or a.size_bytes for a in backward] == [copy]
    assert all(a.freed_at == a.allocated_at for a in forward + backward)
