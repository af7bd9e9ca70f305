"""The staging buffer a CUDA reduction requests when it splits its input across thread blocks.

aten/src/ATen/native/cuda/Reduce.cuh (`setReductionConfig`, `ReduceConfig`, `launch_reduce_kernel`;
torch 2.11-2.14): a reduction that gives each output many inputs and has few outputs for the GPU
splits every output's inputs over `ctas_per_output` blocks and combines their partial results in
global memory. `launch_reduce_kernel` then requests, through the caching allocator,

- `buffer`: `global_memory_size()` = sizeof(acc) * num_outputs * ctas_per_output, times
  block.x * output_vec_size when the block does not reduce along x;
- `semaphores`: sizeof(int) * grid.x,

and frees both when the kernel has been queued. The typical case in training is a Linear bias
gradient (`sum` over the tokens of a [tokens, features] gradient): measured on the lent H100,
every GPT-2, ViT, BERT and DistilBERT configuration of the main suite requested these, e.g.
132.0 MiB for a 3,072-feature bias over 16,384 tokens (docs/validation/h100, allocator traces).

`reduction_staging` follows setReductionConfig for a contiguous input whose reduced dimensions
are all outer or all inner (after dropping size-1 dimensions and merging neighbours), which is
how TensorIterator sees such a tensor; other layouts are left out (returns ()).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WARP_SIZE = 32
MAX_NUM_THREADS = 512  # Reduce.cuh mnt_wrapper<T>::MAX_NUM_THREADS for every real dtype
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
INPUT_VEC_SIZE = 4  # ReduceConfig::input_vec_size (vt0 = 4 for sum and mean)
INT_BYTES = 4

# cudaDeviceProp.maxThreadsPerMultiProcessor by compute capability (CUDA C Programming Guide,
# "Technical Specifications per Compute Capability").
MAX_THREADS_PER_MULTIPROCESSOR = {
    (7, 0): 2048,
    (7, 5): 1024,
    (8, 0): 2048,
    (8, 6): 1536,
    (8, 7): 2048,
    (8, 9): 1536,
    (9, 0): 2048,
    (10, 0): 2048,
    (12, 0): 1536,
}


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


@dataclass
class _Config:
    """ReduceConfig's fields that decide the staging buffer."""

    num_outputs: int
    num_inputs: int
    step_input: int = 1
    step_output: int = 1
    output_vec_size: int = 1
    block_width: int = 1
    block_height: int = 1
    block_x_reduce: bool = False
    ctas_per_output: int = 1

    def split_input(self, parallelism: int) -> None:
        self.step_input *= parallelism

    def split_output(self, parallelism: int) -> None:
        self.step_output *= parallelism

    def values_per_thread(self) -> int:
        return _div_up(self.num_inputs, self.step_input)

    def grid_x(self) -> int:
        return _div_up(self.num_outputs // self.output_vec_size, self.step_output)

    def set_block_dimension(self, dim0: int, dim1: int) -> None:
        max_threads = MAX_NUM_THREADS // self.output_vec_size
        dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
        dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
        self.block_width = min(dim0_pow2, WARP_SIZE)
        self.block_height = min(dim1_pow2, max_threads // self.block_width)
        self.block_width = min(dim0_pow2, max_threads // self.block_height)


def _two_dims(shape: tuple[int, ...], reduced: set[int]) -> tuple[int, int, bool] | None:
    """(outputs, inputs per output, reduced dims inner) of a contiguous tensor whose reduced
    dimensions are all outer or all inner once size-1 dimensions are dropped; else None."""
    kept = [(size, index in reduced) for index, size in enumerate(shape) if size != 1]
    flags = [is_reduced for _, is_reduced in kept]
    if not kept or not any(flags):
        return None
    outputs = inputs = 1
    for size, is_reduced in kept:
        if is_reduced:
            inputs *= size
        else:
            outputs *= size
    if all(flags):
        return 1, inputs, True
    changes = sum(1 for a, b in zip(flags, flags[1:], strict=False) if a != b)
    if changes != 1:
        return None
    return outputs, inputs, flags[-1]


@dataclass(frozen=True)
class Reduction:
    """One CUDA reduction as Reduce.cuh sizes its staging: the part of it the timeline keeps, so a
    timeline interpolated to another batch size can size the staging anew (memplan.estimator.
    interpolate): `inputs_per_output` (or `outputs`) is what the batch scales, the rest stays. A SizedCall
    (memplan.estimator.timeline)."""

    outputs: int
    inputs_per_output: int
    inner: bool  # the reduced dimensions are the innermost ones (reduction_on_fastest_striding_dimension)
    acc_bytes: int  # sizeof(acc_type): 4 for float and the 16-bit types, 8 for double
    compute_capability: tuple[int, int]
    multiprocessors: int
    part: int = 0  # 0: the buffer, 1: the semaphores

    # what the batch scales; every other field stays (memplan.estimator.interpolate)
    SCALED_FIELDS = ("outputs", "inputs_per_output")

    def requests(self) -> tuple[int, ...]:
        """(buffer, semaphores) bytes, or () where it reduces without global memory."""
        return staging_bytes(
            self.outputs,
            self.inputs_per_output,
            self.inner,
            self.acc_bytes,
            self.compute_capability,
            self.multiprocessors,
        )

    def bytes(self) -> int:
        """This part's bytes: 0 where there is no global reduction."""
        requests = self.requests()
        return requests[self.part] if requests else 0


def reduction_of(
    shape: tuple[int, ...],
    reduced_dims: set[int],
    dtype: torch.dtype,
    compute_capability: tuple[int, int],
    multiprocessors: int,
) -> Reduction | None:
    """The reduction a sum or mean of a contiguous `shape` over `reduced_dims` is; None where the
    layout is not covered."""
    layout = _two_dims(shape, reduced_dims)
    if layout is None:
        return None
    outputs, inputs_per_output, inner = layout
    acc_bytes = 8 if dtype in (torch.float64, torch.complex128) else 4  # acc_type: float for 16-bit too
    return Reduction(outputs, inputs_per_output, inner, acc_bytes, compute_capability, multiprocessors)


def reduction_staging(
    shape: tuple[int, ...],
    reduced_dims: set[int],
    dtype: torch.dtype,
    compute_capability: tuple[int, int],
    multiprocessors: int,
) -> tuple[int, ...]:
    """Bytes of (buffer, semaphores) a sum or mean of a contiguous `shape` over `reduced_dims`
    requests on CUDA; () when it reduces without global memory (or the layout is not covered)."""
    reduction = reduction_of(shape, reduced_dims, dtype, compute_capability, multiprocessors)
    return () if reduction is None else reduction.requests()


def staging_bytes(
    num_outputs: int,
    inputs_per_output: int,
    inner: bool,
    acc_bytes: int,
    compute_capability: tuple[int, int],
    multiprocessors: int,
) -> tuple[int, ...]:
    """(buffer, semaphores) bytes of setReductionConfig's plan; () without a global reduction."""
    config = _Config(num_outputs, inputs_per_output)
    if inner:  # reduction_on_fastest_striding_dimension: block.x along the reduced inputs
        dim0, dim1 = inputs_per_output, num_outputs
        if dim0 > 128:  # "vectorize along input" (one reduced dimension after merging)
            dim0 //= INPUT_VEC_SIZE
    else:  # "vectorize along output": 4 where the output row length allows it
        dim0, dim1 = num_outputs, inputs_per_output
        vec = 4
        while num_outputs % vec:
            vec //= 2
        config.output_vec_size = vec
        dim0 //= vec
    config.set_block_dimension(dim0, dim1)
    if inner:
        config.split_input(config.block_width)
        config.block_x_reduce = True
    else:
        config.split_output(config.block_width)
    splits_inputs_over_warps = (
        config.values_per_thread() >= config.block_height * 16 or config.values_per_thread() >= MAX_VALUES_PER_THREAD
    )
    if splits_inputs_over_warps:
        config.split_input(config.block_height)
    else:
        config.split_output(config.block_height)
    threads = config.block_width * config.block_height
    max_threads = MAX_THREADS_PER_MULTIPROCESSOR.get(compute_capability, 2048)
    target_grid_size = multiprocessors * (max_threads // threads)
    grid = config.grid_x()
    if not (
        splits_inputs_over_warps and config.values_per_thread() >= MAX_VALUES_PER_THREAD and grid <= target_grid_size
    ):
        return ()
    values = config.values_per_thread()
    ctas = max(
        min(_div_up(target_grid_size, grid), _div_up(values, MIN_VALUES_PER_THREAD)),
        _div_up(values, MAX_VALUES_PER_THREAD),
    )
    if ctas <= 1:
        return ()
    buffer = acc_bytes * num_outputs * ctas
    if not config.block_x_reduce:
        buffer *= config.block_width * config.output_vec_size
    return buffer, INT_BYTES * grid
