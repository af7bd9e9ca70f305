"""A CPU pointwise (TensorIterator) kernel's copies of its tensors to the op's common dtype: `h * mask` (a bool mask),
`hidden * attention_mask.unsqueeze(-1)` (int64), `scores + mask` of another dtype, `int_tensor / 2`, a bfloat16
parameter's `add_` of a float32 update. A dispatch mode sees the op alone, never these copies
(memplan.estimator.composite_kernels).

`TensorIteratorBase::compute_types` (aten/src/ATen/TensorIterator.cpp, torch 2.11-2.14), for an iterator built with
`promote_inputs_to_common_dtype` (binary ops, comparisons, logical ops, `where`, `addcmul`/`addcdiv`, the unary float
ops with `promote_integer_inputs_to_float`) whose common device is the CPU:

    if (config.cast_common_dtype_to_outputs_ && op.is_output && op.current_dtype != common_dtype_ && !is_meta_) {
      op.exchange_tensor(c10::MaybeOwned<TensorBase>::owned(
          at::empty_like(op.tensor(), op.tensor_base().options().dtype(common_dtype_),
                         LEGACY_CONTIGUOUS_MEMORY_FORMAT)));
      ...
    }
    if (config.promote_inputs_to_common_dtype_ && !op.is_output && op.current_dtype != common_dtype_) {
      op.exchange_tensor(c10::MaybeOwned<TensorBase>::owned(op.tensor().to(common_dtype_)));
      ...
    }

The common dtype is the result type of the inputs (`compute_common_dtype`: a dimensioned tensor outweighs a 0-dim
one, which outweighs a number, each only within its category), moved to the default float dtype for an integral one
where the op promotes integers to float. Each input of another dtype is copied to it whole (its own shape, not the
broadcast one; an expanded or gapped input as its full element count, `.to` allocating it contiguous), and an output
given to the op (in place, or `out=`) of another dtype gets a temporary of the common dtype that is copied back at
the end (`cast_outputs`); a comparison's or logical op's bool output never does (`build_comparison_op`: "special-case
bool outputs"). Everything is held until the op returns. CUDA kernels cast as they load: nothing there.

Measured with the CPU allocator's events (torch.profiler, torch 2.13; tests/test_common_dtype_casts.py): float32 `f *
b` (b bool) allocates a float32 copy of b, then the output; `f * row` a copy of the row alone; `f * s` (s a 0-dim
float64 tensor) 4 B, `i * s` (i int64) a float64 copy of i; `h.add_(f)` (h float16) a float32 temporary of h's shape,
then a float32 copy of h; `torch.sqrt(i)` a float32 copy of i; `f > b` a float32 copy of b beside its bool output.

Python numbers, and their casts, are memplan.estimator.wrapped_numbers': those the parser wraps for a `Tensor`
argument (they reach a dispatch as numbers, not tensors) and those a `Scalar` overload's kernel wraps itself (`h > 0`
is `gt.Scalar`: `wrapped_scalar_tensor(other)`, 8 B, then its cast, 4 B); they only weigh in the common dtype here.
Checked against the allocator's events for every pointwise-tagged overload taking tensors and numbers (float32,
float16, bfloat16, float64, int64, int32 and bool operands, same-shape, 0-dim and broadcast rows): all match but a few
composite ops of other ops (ldexp, deg2rad, rad2deg, gelu_backward of mixed dtypes, square of bool), which still read
low.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from memplan.estimator.memory_formats import meta_like
from memplan.estimator.wrapped_numbers import INT_TO_FLOAT_OPS, NUMBER_DTYPES, UNTAGGED_POINTWISE_OPS

# Tensor arguments of pointwise ops that are not promoted with the others: `where`'s condition (where_self_out reads it
# as bool; its self and other are `.to(result_type)` first, the same copies), masked_fill's mask.
_NOT_PROMOTED = {"condition", "mask"}
# Scalar arguments that become an operand of the iterator (`gt.Scalar`'s other, `pow.Scalar`'s self): they weigh in
# the common dtype as a number does. Others (`alpha`, `value`) scale the result and do not.
_SCALAR_OPERANDS = {"self", "other"}


def is_tensor_iterator_op(func: Any) -> bool:
    """Whether `func` is a pointwise op, built on TensorIterator on the CPU (torch.Tag.pointwise, and the binary ops
    not tagged so)."""
    return torch.Tag.pointwise in getattr(func, "tags", ()) or func in UNTAGGED_POINTWISE_OPS


@functools.cache
def _signature(func: Any) -> tuple[tuple[tuple[int, str, str], ...], tuple[tuple[int, str], ...]]:
    """((position, or -1 where keyword-only; name; "tensor" or "number") of each operand the iterator promotes,
    (position, name) of each output the op is given: a mutated argument, in place or out=)."""
    operands, outputs = [], []
    positional = 0
    for argument in func._schema.arguments:
        index = -1 if argument.kwarg_only else positional
        positional += 0 if argument.kwarg_only else 1
        kind = str(argument.type)
        if argument.alias_info is not None and argument.alias_info.is_write:
            outputs.append((index, argument.name))
            if argument.kwarg_only:  # out=: the op's output, never one of its inputs
                continue
        if kind in ("Tensor", "Optional[Tensor]") and argument.name not in _NOT_PROMOTED:
            operands.append((index, argument.name, "tensor"))
        elif kind in ("number", "Optional[number]") and argument.name in _SCALAR_OPERANDS:
            operands.append((index, argument.name, "number"))
    return tuple(operands), tuple(outputs)


def _value(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if 0 <= index < len(args) else kwargs.get(name)


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _meta(value: Any) -> Any:
    return meta_like(value) if isinstance(value, torch.Tensor) else value


def _promotes_integers_to_float(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the op's iterator moves an integral common dtype to the default float dtype
    (`promote_integer_inputs_to_float`: true division, the unary float ops): a binary float op's by name
    (memplan.estimator.wrapped_numbers), a functional op's by its own output's dtype (its meta kernel builds the same
    iterator) otherwise."""
    if func in INT_TO_FLOAT_OPS:
        return True
    try:
        out = func(*[_meta(arg) for arg in args], **{name: _meta(value) for name, value in kwargs.items()})
    except Exception:  # no meta kernel for it: none assumed
        return False
    return isinstance(out, torch.Tensor) and _is_float(out.dtype)


def common_dtype_casts(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> tuple[int, ...]:
    """The bytes of each copy the op's CPU kernel makes to its common dtype, all held until it returns (an output's
    temporary first, then the inputs' copies); () where it makes none."""
    if device != "cpu" or getattr(func, "_schema", None) is None or not is_tensor_iterator_op(func):
        return ()
    operands, outputs = _signature(func)
    values = [(kind, _value(args, kwargs, index, name)) for index, name, kind in operands]
    tensors = [value for kind, value in values if kind == "tensor" and isinstance(value, torch.Tensor)]
    if not tensors:
        return ()
    given = [out for index, name in outputs if isinstance(out := _value(args, kwargs, index, name), torch.Tensor)]
    dtypes = {tensor.dtype for tensor in (*tensors, *given)}
    if len(dtypes) == 1 and _is_float(next(iter(dtypes))):
        return ()  # the usual case, quickly: one floating dtype throughout (a number cannot move it)
    numbers = [value for _, value in values if type(value) in NUMBER_DTYPES]
    _, common = elementwise_dtypes(*tensors, *numbers, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    if not _is_float(common):  # an in-place op's or out='s by name alone (a float op's integral output would raise)
        if func in INT_TO_FLOAT_OPS or (not given and _promotes_integers_to_float(func, args, kwargs)):
            common = torch.get_default_dtype()
    temporaries = [out for out in given if out.dtype not in (common, torch.bool)]
    copies = [tensor for tensor in tensors if tensor.dtype != common]
    return tuple(tensor.numel() * common.itemsize for tensor in (*temporaries, *copies))
