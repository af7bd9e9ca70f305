"""What an op's C++ kernel allocates inside itself through the other ops it calls (a composite kernel, or a kernel
calling a helper op): a dispatch mode sees the op alone (the Python key is excluded while the op it intercepted
runs), so neither the trace's graph nor memplan's CPU counter has the temporaries those ops make. Each rule is a
pure function of the op's arguments and the target device, returning the bytes held at once beside the op's
output, with its source.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from memplan.estimator.composite_kernels.common_dtype import common_dtype_casts, is_tensor_iterator_op
from memplan.estimator.oprules import _registrar

# op -> rule(args, kwargs, device) -> bytes the kernel holds at its fullest, beside its output: one number, or a tuple
# of the requests it makes and holds together until it returns (the cuda target's allocator sees each of them)
KernelScratchRule = Callable[[tuple[Any, ...], dict[str, Any], str], int | tuple[int, ...]]
COMPOSITE_KERNEL_SCRATCH: dict[Any, KernelScratchRule] = {}
composite_kernel_scratch = _registrar(COMPOSITE_KERNEL_SCRATCH)

# The intra-op threads a plain run in this process would use (`at::get_num_threads()`), read at import: in the
# process the user started, before a forked worker (memplan.forked) sets its own to 1. Kernels that give each thread
# a scratch buffer (CPU flash attention) hold this many; oneDNN leaves small 1x1 convolutions on one thread to THNN
# (convolution). A later torch.set_num_threads in the same process is not seen.
INTRA_OP_THREADS = torch.get_num_threads()

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_REDUCTION_NONE, _REDUCTION_MEAN = 0, 1  # at::Reduction::None and Mean (aten/src/ATen/core/Reduction.h)


def kernel_scratch_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """What `func`'s kernel holds beside its output in this call, by its rule; 0 for an op with none, and for a call
    whose input is no strided tensor (a sparse one's, or a node the trace could not run, which has no fake value)."""
    return sum(kernel_scratch_requests(func, args, kwargs, device))


def kernel_scratch_requests(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[int, ...]:
    """kernel_scratch_bytes as the requests that make it up, where the rule names them (else one); () for none."""
    rule = COMPOSITE_KERNEL_SCRATCH.get(func)
    if rule is None:  # a pointwise op's copies of its tensors to its common dtype, where it makes any
        return common_dtype_casts(func, tuple(args), kwargs, device) if _strided_call(args) else ()
    if not args or not isinstance(args[0], torch.Tensor) or args[0].layout != torch.strided:
        return ()
    held = rule(tuple(args), kwargs, device)
    return tuple(nbytes for nbytes in (held if isinstance(held, tuple) else (held,)) if nbytes)


def may_hold_scratch(func: Any) -> bool:
    """Whether some call of `func` may hold temporaries beside its output: it has a rule, or it is a pointwise op
    (memplan.estimator.composite_kernels.common_dtype)."""
    return func in COMPOSITE_KERNEL_SCRATCH or is_tensor_iterator_op(func)


def _strided_call(args: tuple[Any, ...]) -> bool:
    """Whether the call's first tensor is strided (`where`'s condition, `pow.Scalar`'s number come before the
    others)."""
    first = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
    return first is not None and first.layout == torch.strided


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """`at::opmath_type` (ATen's `toOpMathType`): the dtype a kernel accumulates a float16 or bfloat16 tensor in
    is float32; every other dtype accumulates in itself."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def bound_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by their schema's names, positional or keyword, defaults filled in (None where the schema
    has none)."""
    bound = {}
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args):
            bound[argument.name] = args[position]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value if argument.has_default_value() else None
    return bound


def contiguous_copy_bytes(tensor: torch.Tensor, memory_format: torch.memory_format) -> int:
    """What `tensor.contiguous(memory_format)` allocates: a whole copy unless it is contiguous in that format (then
    it comes back as itself)."""
    return 0 if tensor.is_contiguous(memory_format=memory_format) else _nbytes(tensor)


@composite_kernel_scratch(torch.ops.aten.binary_cross_entropy_with_logits.default)
def bce_with_logits_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`binary_cross_entropy_with_logits` (aten/src/ATen/native/Loss.cpp, CompositeExplicitAutograd, torch
    2.11-2.14):

        auto log_sigmoid_input = at::log_sigmoid(input);
        if (pos_weight) { auto log_weight = (*pos_weight - 1).mul(target).add_(1); log_sigmoid_input.mul_(log_weight); }
        Tensor loss = (1 - target).mul_(input).sub_(log_sigmoid_input);
        if (weight) { loss.mul_(*weight); }
        return apply_loss_reduction(loss, reduction);

    In turn it holds: log_sigmoid_forward's output and its `buffer` (input-sized on the CPU,
    `at::empty({0})` on CUDA: activation.cpp's log_sigmoid_forward_cpu, cuda/ActivationLogSigmoidKernel.cu's
    log_sigmoid_forward_cuda; the buffer is freed as at::log_sigmoid returns); with pos_weight, that output,
    `pos_weight - 1` and `log_weight`; then that output and `loss`, beside the reduced output (unreduced, `loss`
    is the output)."""
    input, target = args[0], args[1]
    weight_and_pos = [*args[2:4], None, None][:2]
    pos_weight = kwargs.get("pos_weight", weight_and_pos[1])
    reduction = kwargs.get("reduction", args[4] if len(args) > 4 else 1)
    log_sigmoid = _nbytes(input)
    buffer = log_sigmoid if device == "cpu" else 0
    loss = target.numel() * target.element_size()
    output = loss if reduction == _REDUCTION_NONE else target.element_size()
    held = [log_sigmoid + buffer]  # before the output exists
    if isinstance(pos_weight, torch.Tensor):
        log_weight = torch.broadcast_shapes(pos_weight.shape, target.shape).numel() * target.element_size()
        held.append(log_sigmoid + _nbytes(pos_weight) + log_weight)
    # `loss` and, reduced, the output made from it: the output is the op's, counted beside this; a mean holds what a
    # mean of `loss` holds inside itself (a float16/bfloat16 one sums a float32 copy on the CPU: mean_input_cast)
    inner_mean = mean_input_cast((target,), {}, device) if reduction == _REDUCTION_MEAN else 0
    held.append(log_sigmoid + loss + (0 if reduction == _REDUCTION_NONE else output) + inner_mean)
    return max(0, max(held) - output)


@composite_kernel_scratch(torch.ops.aten.soft_margin_loss_backward.default)
def soft_margin_loss_backward_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`soft_margin_loss_backward` (aten/src/ATen/native/Loss.cpp, CompositeExplicitAutograd, torch 2.11-2.14):

        auto grad_input = at::empty({0}, input.options());
        // soft_margin_loss_backward_out:
        auto z = at::exp(-target * input);
        at::mul_out(grad_input, target, z).mul_(-norm);
        z.add_(1);
        grad_input.div_(z).mul_(grad_output);

    `-target` and `-target * input` live to the end of the statement, so `exp` runs with both held and its
    output `z`, before grad_input (the output) has grown from 0 elements; then `z` beside the output (measured
    with torch.profiler on the CPU: 3 input-sized buffers at once, the output one of the 3 counted)."""
    input, target = args[1], args[2]
    shape = torch.broadcast_shapes(target.shape, input.shape)
    product = math.prod(shape) * torch.result_type(target, input).itemsize
    output = _nbytes(input)
    held = [_nbytes(target) + 2 * product, product + output]  # neg, the product and z; then z and the output
    return max(0, max(held) - output)


@composite_kernel_scratch(torch.ops.aten.kthvalue.default)
def kthvalue_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The CPU kthvalue (aten/src/ATen/native/Sorting.cpp, kthvalue_out_impl_cpu, torch 2.11-2.14) selects in copies
    of the whole input: `self.clone(at::MemoryFormat::Contiguous)` and `at::empty(self.sizes(), kLong)`, both held
    while it runs (a 0-d input is copied to the output instead). CUDA's selects in place (not modelled: 0)."""
    self = args[0]
    if device != "cpu" or self.dim() == 0:
        return 0
    return self.numel() * (self.element_size() + torch.int64.itemsize)


@composite_kernel_scratch(torch.ops.aten.median.default, torch.ops.aten.nanmedian.default)
def median_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The CPU median of a whole tensor (aten/src/ATen/native/Sorting.cpp, median_impl, torch 2.11-2.14) runs
    `std::nth_element` in `self.clone()`, held while it runs (measured with torch.profiler: one input-sized copy).
    The median along a dimension copies nothing; CUDA's is not modelled (0)."""
    self = args[0]
    return _nbytes(self) if device == "cpu" else 0


@composite_kernel_scratch(torch.ops.aten.sort.default, torch.ops.aten.sort.stable)
def sort_scratch(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The CPU sort kernel (aten/src/ATen/native/cpu/SortingKernel.cpp, sort_kernel, torch 2.11-2.14) first calls
    `_fill_indices(indices, dim)` (aten/src/ATen/native/Sorting.cpp): `at::arange(0, dim_size, kLong)`, copied into
    the indices output and freed as it returns. CUDA's sort (segmented sorts with their own temporary storage) is
    not modelled: 0 there."""
    if device != "cpu":
        return 0
    self = args[0]
    if self.dim() == 0:
        return 0
    # sort(self, dim=-1, descending=False); sort.stable(self, *, stable, dim=-1, descending=False)
    positional_dim = args[1] if len(args) > 1 and not isinstance(args[1], bool) else -1
    dim = kwargs.get("dim", positional_dim)
    return self.shape[dim] * torch.int64.itemsize


def _reduction_dtypes(self: torch.Tensor, dtype: torch.dtype | None, device: str) -> tuple[torch.dtype, torch.dtype]:
    """(out_dtype, in_dtype) of a sum's TensorIterator: `make_reduction_from_out_ty` (aten/src/ATen/native/
    ReduceOpsUtils.h, torch 2.11-2.14) reduces in the output's dtype (an integral or bool input's sum is int64), but a
    CUDA float16/bfloat16 input summed into float32 is read as it is."""
    out_dtype = dtype or (torch.int64 if not self.dtype.is_floating_point and not self.is_complex() else self.dtype)
    cuda_low_to_float = device == "cuda" and self.dtype in _LOW_PRECISION and out_dtype == torch.float32
    return out_dtype, (self.dtype if cuda_low_to_float else out_dtype)


def _numel_out(self: torch.Tensor, dims: Any) -> int:
    """Elements of a reduction's output over `dims` (all where none are given)."""
    if not dims:
        return 1
    reduced = {d % max(self.dim(), 1) for d in dims}
    return math.prod(size for d, size in enumerate(self.shape) if d not in reduced)


@composite_kernel_scratch(torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList)
def sum_input_cast(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """`make_reduction` (ReduceOpsUtils.h) reduces `self.to(in_dtype)` where the dtypes differ: a whole copy of the
    input, on either device, while the sum runs (a bool mask's sum copies it to int64, 8 B an element; measured with
    torch.profiler on the CPU); a CPU float16/bfloat16 sum may reduce float32 copies instead
    (reductions.sum_float_buffer_bytes)."""
    from memplan.estimator.composite_kernels.reductions import sum_float_buffer_bytes

    self, dtype = args[0], kwargs.get("dtype")  # keyword-only in both overloads
    _, in_dtype = _reduction_dtypes(self, dtype, device)
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    cast = 0 if in_dtype == self.dtype else self.numel() * in_dtype.itemsize
    return cast + sum_float_buffer_bytes(self, dims, in_dtype, device)


@composite_kernel_scratch(torch.ops.aten.mean.default, torch.ops.aten.mean.dim)
def mean_input_cast(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """CPU `mean_out` (aten/src/ATen/native/ReduceOps.cpp, torch 2.11-2.14) is `at::sum_out(result, self, ...,
    sum_dtype).div_(dim_prod)`: a float16/bfloat16 mean sums in float32, into `result.to(float)`, reading
    `self.to(float)` (make_reduction); then the divisor, an int64 wrapped scalar (`div_(Scalar)`), is cast to the
    sum's dtype, both held together (measured: 12 B for a float32 mean, 16 B for a float64 one). CUDA's mean
    reduces in one kernel (its input cast as sum's, above)."""
    self = args[0]
    dims, dtype = args[1] if len(args) > 1 else kwargs.get("dim"), kwargs.get("dtype")  # dtype: keyword-only
    out_dtype, in_dtype = _reduction_dtypes(self, dtype, device)
    if device != "cpu":
        return 0 if in_dtype == self.dtype else self.numel() * in_dtype.itemsize
    sum_dtype = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
    item = sum_dtype.itemsize
    result_copy = _numel_out(self, dims) * item if sum_dtype != out_dtype else 0
    input_cast = self.numel() * item if self.dtype != sum_dtype else 0
    return result_copy + max(input_cast, torch.int64.itemsize + item)


def _load_families() -> None:
    from memplan.estimator.composite_kernels import (  # noqa: F401
        batch_norm,
        blas_operands,
        convolution,
        ctc_loss,
        embedding_bag,
        flash_attention,
        layer_group_norm,
        matrix_exp,
        onednn_rnn,
        pooling,
        reductions,
        safe_softmax,
        scatter_gather,
    )


_load_families()
