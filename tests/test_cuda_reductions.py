"""The staging buffer of CUDA's global reductions (memplan/estimator/cuda/reductions.py).

Expected sizes are what the lent H100 requested (docs/validation/h100/traces-main.tar.gz), not
values computed by memplan: each is a Linear bias gradient, a sum over the tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.cuda.reductions import reduction_staging
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings
from tests.module_specs import loss_returning_spec

H100 = ((9, 0), 132)
MiB = 2**20


@pytest.mark.parametrize(
    ("shape", "reduced", "dtype", "measured_bytes", "where"),
    [
        ((16384, 3072), {0}, torch.bfloat16, 138_412_032, "gpt2-bf16, MLP c_fc bias (132.0 MiB)"),
        ((16384, 2304), {0}, torch.bfloat16, 139_198_464, "gpt2-bf16, c_attn bias (132.75 MiB)"),
        ((16384, 768), {0}, torch.bfloat16, 100_663_296, "gpt2-bf16, c_proj bias (96 MiB)"),
        ((8192, 768), {0}, torch.float32, 50_331_648, "gpt2-fp32-adamw, c_proj bias (48 MiB)"),
        ((8192, 768), {0}, torch.bfloat16, 50_331_648, "gpt2-amp-bf16, c_proj bias (48 MiB)"),
        ((64, 197, 768), {0, 1}, torch.bfloat16, 77_463_552, "vit-base-amp-bf16, attention output bias"),
        ((64, 197, 3072), {0, 1}, torch.bfloat16, 138_412_032, "vit-base-amp-bf16, MLP fc1 bias"),
    ],
)
def test_the_staging_buffer_is_what_the_h100_requested(shape, reduced, dtype, measured_bytes, where) -> None:  # type: ignore[no-untyped-def]
    buffer, semaphores = reduction_staging(shape, reduced, dtype, *H100)
    assert buffer == measured_bytes, where
    assert 0 < semaphores < 512  # 4 bytes per block of the grid: one 512-byte block


def test_reductions_that_stay_within_a_block_request_nothing() -> None:
    assert reduction_staging((4, 1024, 50257), {2}, torch.float32, *H100) == ()  # a row-wise sum
    assert reduction_staging((8, 3072), {0}, torch.float32, *H100) == ()  # few inputs per output
    assert reduction_staging((16, 8, 16), {0, 2}, torch.float32, *H100) == ()  # not one outer/inner block
    full = reduction_staging((8 * 2**20,), {0}, torch.float32, *H100)  # a full sum: small partials
    assert full and full[0] < 64 * 1024


def test_the_buffer_follows_the_gpus_multiprocessors() -> None:
    """ctas_per_output = ceil(target grid / grid) where that is the smaller term: a GPU with half
    the multiprocessors gets about half the blocks per output, so about half the buffer."""
    h100 = reduction_staging((16384, 3072), {0}, torch.bfloat16, (9, 0), 132)[0]
    smaller = reduction_staging((16384, 3072), {0}, torch.bfloat16, (9, 0), 66)[0]
    assert smaller == 4 * 3072 * 44 * 32 * 4  # ceil(66 * 16 / 24) = 44 blocks per output, block.x 32, vec 4
    assert smaller < h100


class _BiasedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).square().mean()


def _spec() -> ModelSpec:
    return loss_returning_spec("biased-linear", _BiasedLinear, (4096, 256))


def test_a_bias_gradient_requests_its_staging_after_its_output_on_cuda_only() -> None:
    cuda = simulate(trace_step(_spec(), TrainingSettings(batch_size=2, optimizer="sgd", gpu="H100-80GB")))
    staging = [a for a in cuda.timeline.allocations if a.op.startswith("reduction staging")]
    # [8192 tokens, 512 features] summed over the tokens: 512 / 4 = 128 vectors in 4 blocks of 32;
    # 2048 values per thread after 4 warps: ceil(132 * 16 / 4) = 528 vs ceil(2048 / 16) = 128.
    bias = [a for a in staging if a.allocated_at >= cuda.timeline.forward_end]
    assert [a.requested_bytes for a in bias][:1] == [4 * 512 * 128 * 32 * 4]
    assert all(a.allocated_at == a.freed_at for a in staging)
    # The forward's full mean: partial sums only, a few KiB.
    assert [a.requested_bytes < 64 * 1024 for a in staging if a.allocated_at < cuda.timeline.forward_end] == [
        True,
        True,
    ]
    cpu = simulate(trace_step(_spec(), TrainingSettings(batch_size=2, optimizer="sgd", device="cpu")))
    assert not [a for a in cpu.timeline.allocations if a.op.startswith("reduction staging")]


def test_the_semaphores_are_four_bytes_per_block_of_the_grid_as_measured() -> None:
    """The H100 requested 96, 72 and 24 bytes right after the 132.0, 132.75 and 96 MiB buffers."""
    assert reduction_staging((16384, 3072), {0}, torch.bfloat16, *H100)[1] == 96
    assert reduction_staging((16384, 2304), {0}, torch.bfloat16, *H100)[1] == 72
    assert reduction_staging((16384, 768), {0}, torch.bfloat16, *H100)[1] == 24


@pytest.mark.parametrize(
    ("shape", "reduced", "dtype", "gpu", "expected"),
    [
        # Worked by hand from Reduce.cuh. A100 (sm80, 108 SMs, 2048 threads per SM): 128-thread
        # blocks, 16 per SM, target grid 1728; grid.x = 3072 / 4 / 32 = 24; min(ceil(1728 / 24),
        # ceil(4096 / 16)) = 72 blocks per output; 4 * 3072 * 72 * 32 * 4.
        ((16384, 3072), {0}, torch.bfloat16, ((8, 0), 108), (113_246_208, 96)),
        # RTX 4090 (sm89, 128 SMs, 1536 threads per SM): 12 blocks per SM, target 1536, 64 per output.
        ((16384, 3072), {0}, torch.bfloat16, ((8, 9), 128), (100_663_296, 96)),
        # 770 outputs: vectors of 2, so 256 threads (32 x 8); grid.x = ceil(385 / 32) = 13; target
        # 132 * 8 = 1056; min(ceil(1056 / 13) = 82, ceil(2048 / 16) = 128) = 82; 4 * 770 * 82 * 32 * 2.
        ((16384, 770), {0}, torch.float32, H100, (16_163_840, 52)),
        # float64 accumulates in 8 bytes: twice the float32 buffer of the same shape.
        ((8192, 768), {0}, torch.float64, H100, (100_663_296, 24)),
        # Outer dimensions merge, size-1 ones drop out: the same reduction as (8192, 768).
        ((8, 1024, 768), {0, 1}, torch.float32, H100, (50_331_648, 24)),
        ((1, 8192, 1, 768), {0, 1, 2}, torch.float32, H100, (50_331_648, 24)),
        # Four long rows summed along them (inner): 512-thread blocks of 128 x 4, reducing along x;
        # 2048 values per thread; grid.x 4; min(ceil(528 / 4) = 132, 128) = 128 blocks per output;
        # the buffer holds one float per output and block: 4 * 4 * 128.
        ((4, 2**20), {1}, torch.float32, H100, (2048, 16)),
    ],
)
def test_the_plan_follows_set_reduction_config_worked_by_hand(shape, reduced, dtype, gpu, expected) -> None:  # type: ignore[no-untyped-def]
    assert reduction_staging(shape, reduced, dtype, *gpu) == expected


@pytest.mark.parametrize(
    ("shape", "reduced", "expected"),
    [
        # 64 outputs (16 vectors of 4): 16 x 8 threads; 8192 values per thread; grid.x 1;
        # min(2112, 512) = 512 blocks per output; 4 * 64 * 512 * 16 * 4.
        ((65536, 64), {0}, (8_388_608, 4)),
        # A full sum of 8 Mi floats: one 512-thread block row reducing along x, 528 blocks.
        ((8 * 2**20,), {0}, (2112, 4)),
        # Two kept dimensions (4 x 192) are 768 outputs; a size-2 reduced one still counts.
        ((8192, 4, 192), {0}, (50_331_648, 24)),
        ((2, 4096, 768), {0, 1}, (50_331_648, 24)),
        # grid.x 1056, half the target grid, and 256 values per thread: 2 blocks per output.
        ((1024, 135_168), {0}, (138_412_032, 4224)),
        # grid.x equal to the target grid: one block per output is no global reduction at 256
        # values per thread, but 4 at 1,024 (ceil(1024 / 256)).
        ((1024, 270_336), {0}, ()),
        ((4096, 270_336), {0}, (553_648_128, 8448)),
        # More blocks than the target grid (grid.x 4224): each output stays within its block.
        ((4096, 540_672), {0}, ()),
        # 32 inputs per output: too few to split over the block's warps, so no global reduction.
        ((32, 3072), {0}, ()),
        # 769 outputs allow no vectors: 512 threads (32 x 16); 1,024 values per thread; grid.x 25;
        # target 132 * 4 = 528; min(ceil(528 / 25) = 22, 64) = 22; 4 * 769 * 22 * 32.
        ((16384, 769), {0}, (2_165_504, 100)),
        # Rows of 1,024 summed along them: vectors of 4 make 256 columns for 32 x 16 threads; 32
        # values per thread after the block's x, too few to split over warps: no global reduction.
        ((4096, 1024), {1}, ()),
    ],
)
def test_the_edges_of_the_plan_worked_by_hand(shape, reduced, expected) -> None:  # type: ignore[no-untyped-def]
    assert reduction_staging(shape, reduced, torch.float32, *H100) == expected


def test_a_kept_reduction_sizes_its_staging_on_its_own_gpu() -> None:
    from memplan.estimator.cuda.reductions import reduction_of

    rtx_4090 = reduction_of((16384, 3072), {0}, torch.bfloat16, (8, 9), 128)
    assert rtx_4090 is not None and rtx_4090.bytes() == 100_663_296
    rows = reduction_of((4, 2**20), {1}, torch.float32, *H100)
    assert rows is not None and rows.bytes() == 2048


def test_a_gpu_generation_without_a_listed_thread_limit_gets_2048_threads_per_multiprocessor() -> None:
    """With 2048 threads per multiprocessor and 132 of them, as the H100: the H100's measured
    132.0 MiB buffer and 96 bytes of semaphores for GPT-2's MLP bias."""
    assert reduction_staging((16384, 3072), {0}, torch.bfloat16, (11, 0), 132) == (138_412_032, 96)


class _ColumnNorm(nn.Module):
    """torch.optim.Adafactor's column statistic, `grad.norm(dim=-2)`, of a [tokens, 768] activation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(768, 768, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).flatten(0, 1).norm(dim=-2).sum()


def test_a_column_norm_requests_the_staging_the_h100_requested_for_adafactor() -> None:
    """t5-base-adafactor on the H100: the column norm of each [3,072, 768] weight gradient requested 18,874,368 B
    and 24 B right after its output, of the [32,128, 768] embedding 138,412,032 B and 24 B (ReduceNormKernel.cu
    runs every norm through Reduce.cuh as a sum). Here 1 x 3,072 tokens: the same [3,072, 768] column norm."""
    assert reduction_staging((3072, 768), {0}, torch.float32, *H100) == (18_874_368, 24)
    assert reduction_staging((32128, 768), {0}, torch.float32, *H100) == (138_412_032, 24)
    spec = loss_returning_spec("column-norm", _ColumnNorm, (3072, 768))
    cuda = simulate(trace_step(spec, TrainingSettings(batch_size=1, optimizer="sgd", gpu="H100-80GB")))
    staging = [a for a in cuda.timeline.allocations if a.op == "reduction staging (aten.linalg_vector_norm.default)"]
    assert [a.requested_bytes or a.size_bytes for a in staging] == [18_874_368, 24]


class _MaskCounted(nn.Module):
    """A loss that counts a large bool mask, as `(labels != -100).sum()` counts tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out.square().mean() / (out > 0).sum()


def test_a_bool_masks_sum_requests_its_int64_copy_and_its_staging_together() -> None:
    """make_reduction sums `self.to(kLong)` (ReduceOpsUtils.h): the copy, 8 bytes an element, is held while the
    reduction stages its partial sums; neither request may replace the other."""
    spec = loss_returning_spec("mask-counted", _MaskCounted, (4096, 256))
    timeline = simulate(trace_step(spec, TrainingSettings(batch_size=2, optimizer="sgd", gpu="H100-80GB"))).timeline
    counted = [a for a in timeline.allocations if a.allocated_at < timeline.forward_end and "sum" in a.op]
    copies = [a for a in counted if "own temporaries" in a.op]
    assert [a.requested_bytes for a in copies] == [2 * 4096 * 512 * 8]  # the mask's elements as int64
    staged = [a for a in counted if a.op.startswith("reduction staging") and a.requested_bytes]
    assert staged and {a.allocated_at for a in staged} == {copies[0].allocated_at}
