"""Record every aten op of a run as one node of an `OpGraph`, with the op's output in `meta["val"]`.

A light stand-in for `make_fx(tracing_mode="real")`, which memplan used before: it records the
same post-autograd aten ops (one node per op, `operator.getitem` nodes picking the elements of a
tuple or list result), but skips make_fx's proxy bookkeeping, which took three quarters of a trace
(a 48-block GPT-2 step: 11.0 s under make_fx against 2.6 s running the same step under fake tensors
alone, benchmarks/bench_plan.py), and which breaks selective activation checkpointing: make_fx's
proxy tracking makes checkpoint's policy cache report "Tensor cached during selective activation
checkpoint has been mutated" on a GPT-2 step that runs cleanly under fake tensors alone.

Tensors that no recorded op produced become nodes when first read: the run's inputs as
`placeholder`s, everything else (parameters, buffers, optimizer state, constants the model makes
from Python values) as `get_attr` nodes.

`meta["val"]` holds a detached alias of each tensor (as make_fx's does), never the tensor itself:
the autograd engine decides by reference count whether AccumulateGrad may adopt an incoming
gradient buffer or must copy it (torch/csrc/autograd/functions/accumulate_grad.h), so one extra
reference would add a gradient-sized copy per parameter that the real run does not make.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils.weak import WeakTensorKeyDictionary

from memplan import interrupts
from memplan.estimator.leaves import (
    SPARSE_LAYOUTS,
    SparseTensorRefused,
    local_tensor,
    map_leaves,
    tensors_in,
    wraps_local_tensors,
)
from memplan.estimator.opgraph import OpGraph, OpNode
from memplan.estimator.oprules import real_kernel_outputs
from memplan.estimator.oprules.dtypes import refused_mixed_dtypes
from memplan.estimator.replay import OptimizerRecording, RecordedOp

_DEVICE_QUERY = torch.ops.prim.device.default


def _refuse_sparse_output(func: Any, out: object) -> None:
    """Raise SparseTensorRefused where the op's result (a tensor, or a tuple or list of them) is sparse."""
    for item in out if isinstance(out, tuple | list) else (out,):
        if isinstance(item, torch.Tensor) and item.layout in SPARSE_LAYOUTS:
            raise SparseTensorRefused(func, item.layout, taken=False)


_ALIAS = torch.ops.aten.alias.default


def fake_device_query(func: object, args: Sequence[object]) -> torch.device | None:
    """For `prim.device` on a fake tensor, its answer as FakeTensorMode gives it; else None.

    C++ code asks every tensor it touches for its device (the autograd engine,
    scaled_dot_product_attention). A mode that answers at once spares the modes below it: on a
    48-block GPT-2 step, counted once, these queries were half of all dispatches.
    """
    if func is not _DEVICE_QUERY or not isinstance(args[0], FakeTensor):
        return None
    return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device


# What first reads the number an indexed assignment makes (`ids[:, 0] = 3`: at::indexing::set_item lifts it, then
# fills or copies it in), as under fake tensors.
_SETITEM_OPS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})


class GraphRecorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo unless
        # this says no (torch/utils/_python_dispatch.py). Nothing is compiled inside a trace, and
        # the wrapper cost microseconds on each of a step's tens of thousands of dispatches.
        return False

    def __init__(self, inputs: Sequence[torch.Tensor] = (), target: str = "cpu") -> None:
        super().__init__()
        self.graph = OpGraph()
        self.stream_numbers: dict[object, int] = {}  # side streams, numbered from 1 as first seen
        self._node_of = WeakTensorKeyDictionary()  # tensor -> the node whose output it is now
        self._constants = 0
        self.recording: OptimizerRecording | None = None  # when set, every op is appended to it
        self.target = target  # the device the step is traced for (settings.device): what the output rules read
        # Set where a library swaps tensors' storages outside dispatch (`tensor.data = other`, as
        # DeepSpeed does): a tensor is then read from the op that made its storage now, not the op
        # that made it first. None: not checked (it costs a lookup per input).
        self.producers: dict[int, OpNode] | None = None  # storage's C++ address -> the op that made it
        # storage's C++ address -> the aliases of it the nodes keep (each a reference to the storage that a plain
        # run has not: memplan.estimator.engine_accumulation reads the storage's reference count). The aliases
        # keep each storage alive as long as the graph, so no address is another storage's meanwhile.
        self._aliases: dict[int, int] = {}
        # Set on the cpu target while recording (memplan.estimator.wrapped_numbers.wrapped_numbers_recorded): the
        # Python numbers ops are given for Tensor arguments, real tensors no dispatch shows.
        self.wrapped_numbers: Any = None
        self._finalizers: list[weakref.finalize] = []  # assigned numbers' (node_of), until the recording finishes
        self._reading_for: Any = None  # the op whose arguments node_of is reading, on the cpu target
        for index, tensor in enumerate(inputs):
            node = self.graph.add(OpNode("placeholder", f"input_{index}"))
            node.meta["val"] = self._kept(alias(tensor))
            self._node_of[tensor] = node

    def _kept(self, value: Any) -> Any:
        for tensor in (value,) if isinstance(value, torch.Tensor) else tensors_in(value):
            key = tensor.untyped_storage()._cdata
            self._aliases[key] = self._aliases.get(key, 0) + 1
        return value

    def aliases_of(self, tensor: torch.Tensor) -> int:
        """References to `tensor`'s storage that the graph's nodes hold (their aliases of op outputs)."""
        return self._aliases.get(tensor.untyped_storage()._cdata, 0)

    @property
    def tensor_nodes(self) -> Mapping[torch.Tensor, OpNode]:
        """Each tensor's node: the op whose output it is now (weakly keyed; reading it records nothing)."""
        return self._node_of

    def node_count(self) -> int:
        return len(self.graph.nodes)

    def node_of(self, tensor: torch.Tensor) -> OpNode:
        node = self._node_of.get(tensor)
        if self.producers is not None:
            storage = tensor.untyped_storage()._cdata
            # Its .data was set to another tensor's (or it is read first, a parameter pointed at a storage
            # an op made: ZeRO-3's gathered parameters): the op that made that storage.
            if node is None or node.meta["val"].untyped_storage()._cdata != storage:
                node = self._view_of_producer(tensor, self.producers.get(storage))
        if node is None:
            node = self.graph.add(OpNode("get_attr", f"_constant_{self._constants}"))
            self._constants += 1
            node.meta["val"] = self._kept(alias(tensor))
            self._node_of[tensor] = node
            if (
                self._reading_for in _SETITEM_OPS
                and tensor.dim() == 0
                and not tensor.is_floating_point()
                and not isinstance(tensor, FakeTensor)
            ):
                # A real 0-dim tensor no op made, lifted to a fake one: the number `ids[:, 0] = 3` assigns,
                # which C++ made outside dispatch (THPVariable_setitem's valueToTensor -> scalarToTensor ->
                # `scalar_tensor_static`) and frees as the call returns (the start token seq2seq models write
                # into their shifted labels). Held as long as its PyObject (preserved while C++ holds the
                # tensor); one that outlives the recording stays a constant. Floating-point ones stay constants
                # (the old rule, a few bytes high): DeepSpeed's offloaded step lifts float32 numbers whose host
                # figure moved 8 B away from the one worked by hand when they were let go so, not yet understood.
                # On the cpu target only: on CUDA such a number is host memory.
                self._finalizers.append(weakref.finalize(tensor, self._let_go, node))
        return node

    def _let_go(self, node: OpNode) -> None:
        """A real constant's tensor went: after the last node recorded (liveness reads `freed_after`)."""
        node.meta["freed_after"] = self.node_count() - 1

    def _view_of_producer(self, tensor: torch.Tensor, producer: OpNode | None) -> OpNode | None:
        """`tensor` as a view of the op output that made its storage (an `aten.alias` node with its own
        shape and strides, which ops reading it see), or None where no recorded op made it."""
        if producer is None:
            return None
        made = producer.meta["val"]
        if isinstance(made, torch.Tensor) and (made.shape, made.stride()) == (tensor.shape, tensor.stride()):
            return producer
        node = self.graph.add(OpNode("call_function", _ALIAS, (producer,), None, [producer]))
        node.meta["val"] = self._kept(alias(tensor))
        self._node_of[tensor] = node
        return node

    def _argument(self, value: Any, inputs: list[OpNode], func: Any = None) -> Any:
        """`value` with each tensor replaced by its node, which is appended to `inputs` (`func`: the op that reads
        it, which a sparse tensor's refusal names)."""

        def read(tensor: torch.Tensor) -> OpNode:
            if tensor.layout in SPARSE_LAYOUTS:
                raise SparseTensorRefused(func, tensor.layout, taken=True)
            inputs.append(self.node_of(tensor))
            return inputs[-1]

        return map_leaves(value, torch.Tensor, read)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if interrupts.requested:  # a Ctrl-C swallowed by a finalizer (memplan.interrupts)
            raise KeyboardInterrupt
        if wraps_local_tensors(types):
            return NotImplemented  # recorded as the ops on its local tensors
        kwargs = kwargs or {}
        if func is _DEVICE_QUERY:  # a metadata query, as make_fx leaves it out
            return fake_device_query(func, args) or func(*args, **kwargs)
        refused = refused_mixed_dtypes(func, args)
        if refused is not None:  # the real kernel raises; its fake one computes a shape (oprules.dtypes)
            raise RuntimeError(refused)
        numbers = self.wrapped_numbers
        if numbers is not None:  # the last op's numbers went as it returned: before this op's arguments' nodes
            numbers.settle()
        inputs: list[OpNode] = []
        self._reading_for = func if self.target == "cpu" else None
        try:
            node_args, node_kwargs = self._argument(args, inputs, func), self._argument(kwargs, inputs, func)
        finally:
            self._reading_for = None
        made = numbers.before_op(func, args, kwargs) if numbers is not None else None
        try:
            out = real_kernel_outputs(
                func, args, kwargs, func(*args, **kwargs), self.target
            )  # as the real kernel types them
        except BaseException:
            if made is not None:  # the numbers went with the failed call, not at the end of the trace
                numbers.after_op(made, None)
            raise
        _refuse_sparse_output(func, out)
        val = self._add_node(func, node_args, node_kwargs, inputs, out)
        if made is not None:
            numbers.after_op(made, out)
        if self.recording is not None:
            self.recording.ops.append(RecordedOp(func, args, kwargs, out, val))
        return out

    def _add_node(
        self, func: Any, node_args: Any, node_kwargs: Any, inputs: list[OpNode], out: object, val: object = None
    ) -> object:
        """The op's node (and getitem nodes for a tuple result); `val`: meta["val"] known already."""
        node = self.graph.add(OpNode("call_function", func, node_args, node_kwargs, inputs))
        if (stream := current_side_stream(self.stream_numbers)) is not None:
            node.meta["stream"] = stream
        if isinstance(out, torch.Tensor):
            node.meta["val"] = self._kept(alias(out)) if val is None else val
            self._node_of[out] = node  # in-place ops: later readers read the mutated value here
            if self.producers is not None:
                self.producers[out.untyped_storage()._cdata] = node
        elif isinstance(out, tuple | list):
            node.meta["val"] = self._kept(_snapshot(out)) if val is None else val
            for index, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    element = self.graph.add(OpNode("call_function", operator.getitem, (node, index), None, [node]))
                    element.meta["val"] = node.meta["val"][index]
                    self._node_of[item] = element
                    if self.producers is not None:
                        self.producers[item.untyped_storage()._cdata] = element
        else:
            node.meta["val"] = out
        return node.meta["val"]

    def replay(self, recording: OptimizerRecording, grads: Sequence[torch.Tensor]) -> None:
        """Add the recorded ops' nodes as if they ran again, on `grads` in place of the recorded gradients.

        Only for a recording that `is_replayable` and `matches(grads)`: then every tensor an op
        reads is a new gradient, one that outlives traces, or an output of an earlier replayed op.
        """
        substitute = recording.substituted(grads)

        def swap(tensor: torch.Tensor) -> torch.Tensor:
            return substitute.get(id(tensor), tensor)

        with _pop_mode_temporarily():  # as inside __torch_dispatch__: what node_of runs is not recorded
            numbers = self.wrapped_numbers
            for op in recording.ops:
                inputs: list[OpNode] = []
                node_args = self._argument(map_leaves(op.args, torch.Tensor, swap), inputs)
                node_kwargs = self._argument(map_leaves(op.kwargs, torch.Tensor, swap), inputs)
                made = numbers.before_op(op.func, op.args, op.kwargs) if numbers is not None else None
                if any(id(tensor) in substitute for tensor in tensors_in(op.out)):
                    # It wrote a gradient in place and returned it: the new gradient, with a new alias.
                    self._add_node(op.func, node_args, node_kwargs, inputs, map_leaves(op.out, torch.Tensor, swap))
                else:
                    self._add_node(op.func, node_args, node_kwargs, inputs, op.out, op.val)
                if made is not None:
                    numbers.after_op(made, None)  # the optimizer's step runs without grad: nothing saves them
                    numbers.settle()

    def finish(self, outputs: object) -> OpGraph:
        """Close the graph with an output node reading the tensors in `outputs` (what outlives the run)."""
        read = [self.node_of(local_tensor(tensor)) for tensor in tensors_in(outputs)]
        for finalizer in self._finalizers:  # what is alive now outlives the step
            finalizer.detach()
        self._finalizers.clear()
        self.graph.add(OpNode("output", "output", (read,), None, read))
        return self.graph


def current_side_stream(numbers: dict[object, int]) -> int | None:
    """The number of the stream ops run on now, if not the default one (None).

    memplan traces on fake CPU tensors, so device-agnostic code that runs ops on side streams (FSDP2's
    all-gathers and reduce-scatters: `_get_device_handle(device.type).stream(...)`) selects them
    through torch.cpu's stand-in streams; on CUDA each is a stream of its own, whose caching-allocator
    pools keep what is allocated on it (memplan.estimator.cuda.allocator). Numbered from 1 in the
    order first seen, in `numbers`.
    """
    stream = torch.cpu.current_stream()
    if stream is _DEFAULT_CPU_STREAM:
        return None
    return numbers.setdefault(stream, len(numbers) + 1)


_DEFAULT_CPU_STREAM = torch.cpu.current_stream()


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor sharing `tensor`'s storage, shape and strides: what a node keeps of its output.

    For a fake tensor, the meta tensor inside it, detached, as `fast_detach` makes it
    (torch/_subclasses/fake_impls.py) but not wrapped in a new FakeTensor: wrapping took (timed once) about half of
    recording an op. Nothing reads a node's value but its metadata and storage.
    """
    if not isinstance(tensor, FakeTensor):
        return tensor.detach()
    with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
        torch._C._set_meta_in_tls_dispatch_include(True)
        return torch.ops.aten.detach.default(tensor)


def _snapshot(value: object) -> object:
    """What a node keeps of its output: tensors aliased, also inside tuples and lists (a collective's
    `([tensors], work)`), so that the node never keeps the op's own tensor objects, whose finalizers
    tell when Python lets go of them (memplan.estimator.eager_lifetimes)."""
    if isinstance(value, torch.Tensor):
        return alias(value)
    if isinstance(value, tuple | list):
        return type(value)(_snapshot(item) for item in value)
    return value


def record_graph(fn: Callable[..., object], *inputs: torch.Tensor) -> OpGraph:
    """`fn(*inputs)` recorded; the tensors it returns are the graph's outputs."""
    with GraphRecorder(inputs) as recorder:
        outputs = fn(*inputs)
    return recorder.finish(outputs)
