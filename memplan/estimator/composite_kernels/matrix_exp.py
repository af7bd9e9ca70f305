"""The temporaries `linalg_matrix_exp`'s kernel holds inside itself (aten/src/ATen/native/LinearAlgebra.cpp, `mexp`,
the same code on the CPU and CUDA, torch 2.11-2.14), which no dispatch mode sees. Its backward
(linalg_matrix_exp_differential) exponentiates a [2n, 2n] block matrix through the same op, so this rule covers both.

Which Taylor degree runs depends on the values: a lone matrix's 1-norm picks compute_T1 ... compute_T12, or beyond
theta_12 (1.46 in float32) the degree-18 polynomial with scaling and squaring; a fake tensor has no values, so memplan
counts the top of that range (torch.nn.utils.parametrizations.orthogonal's default map, a Linear(64, 64), holds
98,320 B at a norm of 0.01, 147,468 B at 1.0, 196,632 B from 1.46 up). A batch of matrices always takes the
degree-18 path, its squarings grouped by each matrix's scale; the top counted there is every matrix squared apart, in
as many groups as finite norms have scales (128 for float32).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from memplan.estimator.composite_kernels import composite_kernel_scratch

_INDEX = torch.int64.itemsize
_T18_PRODUCTS = 5  # compute_T18's num_prods: As and Bs hold 5 matrices each
# theta_18, the 1-norm that compute_T18_scale_square scales each matrix below (mexp_impl's `thetas`, last entry, per
# real dtype; LinearAlgebra.cpp, torch 2.11-2.14)
_THETA_18 = {torch.float32: 3.010066362817634e00, torch.float64: 1.090863719290036e00}


def _most_scales(real: torch.dtype) -> int:
    """How many distinct scales `s = max(0, ceil(log2(norm / theta_18)))` finite norms of `real` can take: the most
    groups compute_T18_scale_square's squarings split a batch into (128 for float32, 1,025 for float64)."""
    theta = _THETA_18.get(real)
    if theta is None:
        return 1 << 62  # a dtype mexp's table does not name: no bound but the batch
    return 1 + math.ceil(math.log2(torch.finfo(real).max / theta))


@composite_kernel_scratch(torch.ops.aten.linalg_matrix_exp.default)
def matrix_exp_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[int, ...]:
    """What mexp_impl holds at its fullest beside its output, at the top of the norm's range (the requests live then).

    The input is viewed as `a` of [batch, n, n]; `norm = operator_1_norm(a)` (batch reals) lives throughout; n < 2
    is a clone or an elementwise exp (nothing held).

    One matrix (`!compute_highest_degree_approx`): `res = at::full_like(a, NaN)`, the output, first; then for a norm
    above theta_12, `idx_large_norm` (one int64), `a_large_norm = index_select(a, ...)`, `large_norm_subset` (one
    real) and compute_T18_scale_square: `s` and `pow2s` (a real each), `a_scaled`, then compute_T18's
    `As = _allocate_buffer(A, 5)` and `Bs = _compute_linear_combination(As, bs)` (5 matrices each), its fullest
    (measured with torch.profiler: 196,632 B for a float32 64x64, 393,256 B for float64). The lower degrees hold
    fewer (compute_T12: 4 + 4 matrices).

    A batch: compute_T18_scale_square(a, norm) alone, no `res`: `s`, `pow2s`, `a_scaled`, As and Bs before the
    output exists (held beside it: that less one batch of matrices); then, after the squarings, the matrices sorted
    by scale, each group's last product kept by `output_pieces` (a slice of an accumulator as long as the groups left:
    with every matrix its own group, batch + batch-1 + ... + 1 matrices), `at::cat` of them and the output
    (`index_select`), beside Bs, `a_scaled` and the int64 bookkeeping (sorted scales and their indices, the groups'
    counts, edges, scales and steps, their `cat`, the inverse permutation). On CUDA `bs` (compute_T18's 5x5
    coefficients) is copied to the device beside As and Bs, and the bookkeeping's `cat` is read on the host."""
    a = args[0]
    if a.dim() < 2 or a.shape[-1] < 2:
        return ()
    n = a.shape[-1]
    batch = a.numel() // (n * n)
    if batch == 0:
        return ()
    matrix = n * n * a.element_size()
    real = a.dtype.to_real().itemsize
    coefficients = (_T18_PRODUCTS * _T18_PRODUCTS * real,) if device == "cuda" else ()
    buffers = (_T18_PRODUCTS * batch * matrix,) * 2  # As, Bs
    # sorted scales and their indices, the groups' counts, edges, scales and steps, the inverse permutation; their
    # `cat` (two int64 a group) stays on the CPU
    bookkeeping = (batch * _INDEX,) * 7 + ((2 * batch * _INDEX,) if device == "cpu" else ())
    # each group's accumulator: the groups before it one matrix each, as many groups as the dtype has scales (never
    # more: a batch of 1,000 float32 4x4 matrices, every scale apart, holds 128 accumulators, not 1,000)
    groups = min(batch, _most_scales(a.dtype.to_real()))
    kept = tuple((batch - first) * matrix for first in range(groups))
    if batch == 1:  # norm, idx_large_norm, large_norm_subset, s, pow2s; a_large_norm, a_scaled; ...
        scalars = (real, _INDEX, real, real, real)
        before_output = (*scalars, matrix, matrix, *coefficients, *buffers)  # ... As, Bs
        # ... Bs, the accumulator, its cat and compute_T18_scale_square's output (all beside `res`, the output)
        after_squaring = (*scalars, matrix, matrix, *bookkeeping, buffers[1], *kept, matrix, matrix)
    else:
        scales = (batch * real,) * 3  # norm, s, pow2s
        before_output = (*scales, *coefficients, *buffers)  # a_scaled too, which the output's own bytes stand for
        # Bs, a_scaled, the accumulators and their cat, beside the output
        after_squaring = (*scales, *bookkeeping, buffers[1], batch * matrix, *kept, batch * matrix)
    return before_output if sum(before_output) >= sum(after_squaring) else after_squaring
