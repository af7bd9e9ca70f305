"""Python numbers given for an op's Tensor argument, real 0-dim CPU tensors on the cpu target.

`y * 0.5`, `x / 3`, `torch.add(x, 1)`, peft's `lora_B(lora_A(x)) * scaling`: torch's Python argument parser makes a
number given for a `Tensor` argument a "wrapped number" (`wrapped_scalar_tensor`/`scalar_to_tensor`: float64 for a
float, int64 for an int, bool, complex128; torch/csrc/utils/python_arg_parser.cpp), a real CPU tensor allocated
outside the dispatcher, before the op runs. A dispatch mode sees the number unwrapped, as a Python scalar.

- It lives while the op runs, then goes with the parser's temporaries, unless the op's autograd formula saves it
  (MulBackward0's `other`, DivBackward0's: tools/autograd/derivatives.yaml). Then its Node holds it until the
  Node's saved variables are released (after the Node ran, or with its graph), and saved_tensors_hooks never see
  it (SavedVariable skips wrapped numbers: torch/csrc/autograd/saved_variable.cpp), so neither memplan's
  SavedTensors nor a checkpoint's hooks do: a checkpointed region's saved numbers stay with its graph.
- A pointwise (TensorIterator) CPU kernel casts it to the op's common dtype where that differs
  (`TensorIteratorBase::compute_types`: `op.tensor().to(common_dtype_)` for a CPU input): one more element of that
  dtype while the op runs, freed before it returns. CUDA passes a CPU scalar to its kernels by value.

A `Scalar` overload whose CPU kernel makes its number a tensor itself (`wrapped_scalar_tensor(other)`, then the
Tensor overload: aten/src/ATen/native/BinaryOps.cpp's add/sub/mul/div/rsub/remainder/fmod/bitwise/shift/comparison
`Scalar` kernels, pow.Scalar, xlogy's and the special functions' scalar overloads) does the same below the dispatcher:
`x > 0`, `1 - x`, `x % 2`, `2 ** x` from Python, and `grad * 0.5`-like products in C++ autograd formulas, which reach
the dispatch as mul.Scalar. That number (and its cast) lives only while the op runs: autograd saved the Scalar, not
it. Kernels that read a Scalar by value allocate nothing for it (clamp, masked_fill, fill_, lerp, pow.Tensor_Scalar,
leaky_relu, hardtanh, threshold, an `alpha`).

Measured with torch.profiler's memory events (torch 2.13): `x * 0.5` (float32 x, no grad) allocates 8 B, 4 B, the
output, then frees 4 B and 8 B; with x requiring grad the 8 B stays until MulBackward0 has run.

Each is recorded as a storage of its own, as memplan.estimator.rng_snapshots records the generator's state: a
StorageResize to its bytes at the op (`at` the op's own index) and one back to 0 when it goes. Autograd makes the
op's Node only after the dispatch returns, so whether the formula saved the number is settled at the next dispatch
(or as recording ends), by reading the output's `grad_fn._saved_<argument>`; a saved one is freed when Python's
object for it is (PyObject preservation keeps that object while the Node holds the tensor). Nothing on cuda (host
memory there).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from torch._subclasses.fake_tensor import FakeTensor

from memplan.distributed.fsdp import StorageResize

NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}
_TENSOR_ARGUMENTS: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> (position, name) of its `Tensor` arguments


class WrappedNumber:
    """The key of one wrapped number's storage (a number, never an address a later storage may reuse)."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"WrappedNumber({self.number})"


def _tensor_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """Only an op with a schema is kept: a dispatch mode may run a Python function in an op's place (the plain
    formula paths' closures, new at each backward Node), which a module-level cache would keep, and what it holds,
    for the process's life."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    found = _TENSOR_ARGUMENTS.get(func)
    if found is None:
        found = tuple(
            (index, argument.name)
            for index, argument in enumerate(schema.arguments)
            if not argument.kwarg_only and str(argument.type) == "Tensor"
        )
        _TENSOR_ARGUMENTS[func] = found
    return found


def wrapped_numbers_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """(argument name, value) of each Python number the op was given for a `Tensor` argument."""
    found = []
    for index, name in _tensor_arguments(func):
        value = args[index] if index < len(args) else kwargs.get(name)
        if type(value) in NUMBER_DTYPES:
            found.append((name, value))
    return found


# TensorIterator binary ops not tagged pointwise (aten/src/ATen/native/BinaryOps.cpp: floor_divide builds a binary_op)
UNTAGGED_POINTWISE_OPS = {torch.ops.aten.floor_divide.default, torch.ops.aten.floor_divide_.Tensor}
# Binary ops built with `build_borrowing_binary_float_op` (BinaryOps.cpp: true division, atan2, xlogy, ...): integer
# inputs promote to the default float dtype, the common dtype their numbers are cast to (`i / 2` casts the 2)
INT_TO_FLOAT_OPS = {
    torch.ops.aten.div.Tensor,
    torch.ops.aten.div_.Tensor,
    torch.ops.aten.true_divide.Tensor,
    torch.ops.aten.true_divide_.Tensor,
    torch.ops.aten.atan2.default,
    torch.ops.aten.atan2_.default,
    torch.ops.aten.xlogy.Tensor,
    torch.ops.aten.xlogy_.Tensor,
    torch.ops.aten.special_xlog1py.default,
    torch.ops.aten.special_zeta.default,
}


def _overloads(names: str) -> frozenset[Any]:
    """The aten overloads named `packet.overload` in `names` (those this torch has)."""
    found = set()
    for name in names.split():
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            found.add(op)
    return frozenset(found)


# Scalar overloads whose CPU kernel wraps its number(s) itself (`wrapped_scalar_tensor`, BinaryOps.cpp and the special
# functions' `*_scalar` overloads), then runs the Tensor overload: the number as a 0-dim tensor for the op's duration,
# cast to the common dtype. Each found by the CPU allocator's events of the op run plainly (an 8-byte request).
_KERNEL_WRAPPED = _overloads(
    """add.Scalar add_.Scalar sub.Scalar sub_.Scalar mul.Scalar mul_.Scalar div.Scalar div_.Scalar div.Scalar_mode
    div_.Scalar_mode rsub.Scalar _add_relu.Scalar _add_relu_.Scalar remainder.Scalar remainder_.Scalar
    remainder.Scalar_Tensor fmod.Scalar fmod_.Scalar floor_divide.Scalar floor_divide_.Scalar copysign.Scalar
    copysign_.Scalar eq.Scalar eq_.Scalar ne.Scalar ne_.Scalar lt.Scalar lt_.Scalar le.Scalar le_.Scalar gt.Scalar
    gt_.Scalar ge.Scalar ge_.Scalar bitwise_and.Scalar bitwise_and_.Scalar bitwise_and.Scalar_Tensor bitwise_or.Scalar
    bitwise_or_.Scalar bitwise_or.Scalar_Tensor bitwise_xor.Scalar bitwise_xor_.Scalar bitwise_xor.Scalar_Tensor
    bitwise_left_shift.Tensor_Scalar bitwise_left_shift_.Tensor_Scalar bitwise_left_shift.Scalar_Tensor
    bitwise_right_shift.Tensor_Scalar bitwise_right_shift_.Tensor_Scalar bitwise_right_shift.Scalar_Tensor
    __lshift__.Scalar __ilshift__.Scalar __rshift__.Scalar __irshift__.Scalar pow.Scalar xlogy.Scalar_Other
    xlogy.Scalar_Self xlogy_.Scalar_Other special_xlog1py.self_scalar special_xlog1py.other_scalar
    special_zeta.self_scalar special_zeta.other_scalar"""
    + " ".join(
        f" special_{kind}_polynomial_{letter}.{scalar}_scalar"
        for kind, letters in (
            ("chebyshev", "tuvw"),
            ("shifted_chebyshev", "tuvw"),
            ("hermite", ("h", "he")),
            ("laguerre", "l"),
            ("legendre", "p"),
        )
        for letter in letters
        for scalar in ("x", "n")
    )
)
# ... of which these promote integer inputs to the default float dtype (true division, xlogy, the special functions)
INT_TO_FLOAT_OPS |= {
    op
    for op in _KERNEL_WRAPPED
    if "_polynomial_" in op._schema.name
    or (
        op._schema.name.removeprefix("aten::").rstrip("_") in ("div", "xlogy", "special_xlog1py", "special_zeta")
        and op._schema.overload_name != "Scalar_mode"  # rounds: the inputs' own dtype
    )
}
_KERNEL_SCALARS: dict[Any, tuple[tuple[int, str], ...]] = {
    op: tuple(
        (index, argument.name)
        for index, argument in enumerate(op._schema.arguments)
        if not argument.kwarg_only and str(argument.type) == "number" and argument.name != "alpha"
    )
    for op in _KERNEL_WRAPPED
}


def kernel_wrapped_numbers_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The Python numbers a `Scalar` overload's kernel wraps itself (`x > 0`'s 0, mul.Scalar's number)."""
    found = []
    for index, name in _KERNEL_SCALARS.get(func, ()):
        value = args[index] if index < len(args) else kwargs.get(name)
        if type(value) in NUMBER_DTYPES:
            found.append(value)
    return found


def _cast_bytes(func: Any, args: tuple[Any, ...], values: list[Any]) -> int:
    """A pointwise kernel's casts of its wrapped numbers to its common dtype (TensorIterator's `compute_types`: the
    result type of its tensors and numbers, a number of a higher category moving it, a 0-dim tensor weighing less
    than a dimensioned one)."""
    if (
        torch.Tag.pointwise not in getattr(func, "tags", ())
        and func not in UNTAGGED_POINTWISE_OPS
        and func not in _KERNEL_WRAPPED
    ):
        return 0
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    if not tensors:
        return 0
    operands = [*tensors, *values]  # not an `alpha`, which the kernel reads by value
    kind = (
        ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT
        if func in INT_TO_FLOAT_OPS
        else ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    )
    _, common = elementwise_dtypes(*operands, type_promotion_kind=kind)
    return sum(common.itemsize for value in values if NUMBER_DTYPES[type(value)] != common)


class WrappedNumbers:
    """The wrapped numbers of the ops it is shown, told to `made(key, nbytes)` as an op is given them and to
    `freed(key)` when they go; a kernel's casts of them likewise, made before the op and freed after it."""

    def __init__(
        self,
        made: Callable[[WrappedNumber, int], None],
        freed: Callable[[WrappedNumber], None],
    ) -> None:
        self._made, self._freed = made, freed
        self._numbers = 0
        # the op's output(s), weakly, with (argument name, dtype, key) of each number it was given
        self._pending: list[tuple[list[weakref.ref], list[tuple[str, torch.dtype, WrappedNumber]]]] = []
        self._finalizers: list[weakref.finalize] = []

    def before_op(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], kernel_measured: bool = False
    ) -> tuple[list, WrappedNumber | None]:
        """Settle the previous op's numbers; make this op's, and its kernel's casts of them (one storage, freed by
        after_op): what after_op takes. `kernel_measured`: the call's allocations are read off the allocator
        (memplan.measure.cpu profiles it, a real run's call, which wraps its numbers after the dispatch mode saw them):
        nothing is made here. (A number such a call saves for backward is then not counted after it: a mixed-dtype
        op given a Python number and an input that requires grad.)"""
        self.settle()
        if kernel_measured:
            return [], None
        numbers = wrapped_numbers_of(func, args, kwargs)
        own = kernel_wrapped_numbers_of(func, args, kwargs)
        if not numbers and not own:
            return [], None
        made = []
        if not _in_cpp_formula():
            for name, value in numbers:
                dtype = NUMBER_DTYPES[type(value)]
                made.append((name, dtype, self._new(dtype.itemsize)))
        # the kernel's own numbers go with its casts, as the op returns
        transient = sum(NUMBER_DTYPES[type(value)].itemsize for value in own)
        transient += _cast_bytes(func, args, [value for _, value in numbers] + own)
        return made, self._new(transient) if transient else None

    def _new(self, nbytes: int) -> WrappedNumber:
        key = WrappedNumber(self._numbers)
        self._numbers += 1
        self._made(key, nbytes)
        return key

    def after_op(self, made: tuple[list, WrappedNumber | None], out: object) -> None:
        """After the op's outputs were made: its casts freed, its numbers pending until the next op (or close). An
        op that raised is told with `out` None: nothing keeps its numbers, freed as the next op settles them (a
        caller that catches the error goes on without them)."""
        numbers, cast = made
        if cast is not None:
            self._freed(cast)
        if not numbers:
            return
        leaves = out if isinstance(out, tuple | list) else (out,)
        outputs = [weakref.ref(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self._pending.append((outputs, numbers))

    def settle(self) -> None:
        """Each pending number as its op's Node keeps it (freed with the Node's saved variables) or not (freed now)."""
        pending, self._pending = self._pending, []
        for outputs, made in pending:
            nodes = [tensor.grad_fn for ref in outputs if (tensor := ref()) is not None and tensor.grad_fn is not None]
            for name, dtype, key in made:
                saved = next((found for node in nodes if (found := _saved(node, name, dtype)) is not None), None)
                if saved is None:
                    self._freed(key)
                else:
                    self._finalizers.append(weakref.finalize(saved, self._freed, key))

    def close(self) -> None:
        """Settle what is pending; a number still saved keeps no callback (it reads as live to the end)."""
        self.settle()
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()


def _in_cpp_formula() -> bool:
    """Whether the op runs in a C++ backward formula: its numbers are the ones its Node saved, allocated already
    (`grad * other` in MulBackward0 reads the saved wrapped number: measured, no allocation but the cast). Not a
    Python Function's backward, nor a checkpoint's recomputation (Python code under grad mode, inside an unpack)."""
    if torch.is_grad_enabled():
        return False
    node = torch._C._current_autograd_node()
    return node is not None and not isinstance(node, torch.autograd.function.BackwardCFunction)


def _saved(node: Any, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The wrapped number `node` saved for its argument `name`, if it did (a saved number skips every hook: reading
    it unpacks nothing else)."""
    try:
        saved = getattr(node, f"_saved_{name}")
    except (AttributeError, RuntimeError):  # no such saved argument, or released already
        return None
    if (
        isinstance(saved, torch.Tensor)
        and not isinstance(saved, FakeTensor)
        and saved.dim() == 0
        and saved.dtype == dtype
        and saved.device.type == "cpu"
    ):
        return saved
    return None


@contextlib.contextmanager
def wrapped_numbers_recorded(
    node_count: Callable[[], int], device: str, recorder: Any
) -> Iterator[list[StorageResize]]:
    """The wrapped numbers of the ops `recorder` (a GraphRecorder) records while active, as resizes to their bytes
    at their op and back to 0 when they go (a cast as its own storage over the op alone); none unless `device` is the
    CPU."""
    resizes: list[StorageResize] = []
    if device != "cpu":
        yield resizes
        return
    sizes: dict[WrappedNumber, int] = {}

    def made(key: WrappedNumber, nbytes: int) -> None:
        sizes[key] = nbytes
        resizes.append(StorageResize(key, node_count(), 0, nbytes))  # type: ignore[arg-type]

    def freed(key: WrappedNumber) -> None:
        resizes.append(StorageResize(key, node_count(), sizes.pop(key), 0))  # type: ignore[arg-type]

    numbers = WrappedNumbers(made, freed)
    recorder.wrapped_numbers = numbers
    try:
        yield resizes
    finally:
        recorder.wrapped_numbers = None
        numbers.close()
