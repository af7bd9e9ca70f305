"""The partial-sum buffers CUDA's layer norm backward allocates inside itself for a tall input (many rows, few
columns), which the traced `native_layer_norm_backward` does not show.

aten/src/ATen/native/cuda/layer_norm_kernel.cu (torch 2.11-2.14), `LaunchGammaBetaBackwardCUDAKernel`, run where
the weight or bias gradient is asked for (and M > 0, N > 0):

    constexpr int block_dim_x = 32;                     // 64 on ROCm
    const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    if (M > 64 * 1024 && N / block_dim_x < sm_count / 2) {
      constexpr int block_dim_y = 1;
      constexpr int rows_per_block_y = 32;
      blocks.x = (N + block_dim_x - 1) / block_dim_x;
      blocks.y = (M + rows_per_block_y - 1) / rows_per_block_y;
      constexpr int max_grid_size = 64 * 1024 / 2;
      blocks.y = std::min<unsigned int>(max_grid_size / blocks.x, blocks.y);
      if (dgamma->defined()) dgamma_blocks = at::empty({blocks.y * threads.y, dgamma->size(-1)}, dgamma->options());
      if (dbeta->defined())  dbeta_blocks  = at::empty({blocks.y * threads.y, dgamma->size(-1)}, dbeta->options());
      ... partial-sum kernel ...
      if (dgamma_blocks.defined()) *dgamma = dgamma_blocks.sum(0);
      if (dbeta_blocks.defined())  *dbeta  = dbeta_blocks.sum(0);
    }

The two partial buffers, in the gradients' dtype (the weight's), are held until the function returns; each
`sum(0)` makes a new [N] gradient while the one `layer_norm_backward_cuda` allocated is still referenced, and
that old one is freed only when the assignment replaces it: one [N] more at a time. (The sum's own staging is
not modelled here.) Below the threshold the column kernels write dgamma and dbeta directly: nothing.
ConvNeXt's channels-last LayerNorm (M = batch x H x W rows of N = C channels) takes this path from 65,537 rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK_DIM_X = 32  # CUDA; ROCm's 64 is not a target
ROWS_PER_BLOCK_Y = 32
MAX_GRID_SIZE = 64 * 1024 // 2
TALL_ROWS = 64 * 1024  # `M > 64 * 1024`

LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default


def partial_rows(rows: int, columns: int, multiprocessors: int) -> int:
    """`blocks.y * threads.y`, the partial buffers' rows, where the tall-input path runs; 0 where it does not."""
    if rows <= TALL_ROWS or columns // BLOCK_DIM_X >= multiprocessors // 2 or columns == 0:
        return 0
    blocks_x = (columns + BLOCK_DIM_X - 1) // BLOCK_DIM_X
    return min(MAX_GRID_SIZE // blocks_x, (rows + ROWS_PER_BLOCK_Y - 1) // ROWS_PER_BLOCK_Y)


@dataclass(frozen=True)
class GammaBetaPartials:
    """One layer norm backward's tall-input requests (a SizedCall: `rows` is what the batch scales, and the path
    turns on past a threshold of it). Parts: 0 dgamma_blocks, 1 dbeta_blocks, 2 the extra [N] gradient a
    `sum(0)` makes before the old one is freed."""

    rows: int  # M
    columns: int  # N
    itemsize: int  # the weight gradient's dtype's
    weight_grad: bool
    bias_grad: bool
    multiprocessors: int
    part: int = 0

    SCALED_FIELDS = ("rows",)

    def requests(self) -> tuple[int, ...]:
        """(dgamma_blocks, dbeta_blocks, one [N] gradient) bytes; () where the path does not run."""
        partial = partial_rows(self.rows, self.columns, self.multiprocessors)
        if not partial or not (self.weight_grad or self.bias_grad):
            return ()
        block = partial * self.columns * self.itemsize
        return (
            block if self.weight_grad else 0,
            block if self.bias_grad else 0,
            self.columns * self.itemsize,
        )

    def bytes(self) -> int:
        requests = self.requests()
        return requests[self.part] if requests else 0


def gamma_beta_partials(
    input: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_mask: list[bool],
    multiprocessors: int,
) -> tuple[GammaBetaPartials, ...]:
    """The three parts of a layer norm backward's tall-input requests (each 0 bytes where the path does not run at
    this size, so that other batch sizes can size them anew); () where no weight or bias gradient is asked for."""
    weight_grad = bool(output_mask[1]) and weight is not None
    bias_grad = bool(output_mask[2]) and bias is not None
    if not (weight_grad or bias_grad):
        return ()
    columns = math.prod(normalized_shape)
    rows = input.numel() // columns if columns else 0
    grad_source = weight if weight is not None else bias
    assert grad_source is not None
    call = GammaBetaPartials(rows, columns, grad_source.element_size(), weight_grad, bias_grad, multiprocessors)
    return tuple(GammaBetaPartials(**{**call.__dict__, "part": part}) for part in range(3))
