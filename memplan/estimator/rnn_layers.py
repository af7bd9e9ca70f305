"""ATen's CPU recurrent layers hold each layer's input projection in a C++ variable past its last use by an op.

nn.GRU, nn.RNN and nn.LSTM (where oneDNN does not run it: mkldnn off, float16 with grad) call one C++
composite, `_VF.gru` / `_VF.rnn_tanh` / `_VF.rnn_relu` / `_VF.lstm`, that runs as ops memplan sees
(aten/src/ATen/native/RNN.cpp, torch 2.11-2.14). On the CPU each layer first projects the whole sequence,
`input_w = params.linear_ih(input)`, and runs its steps on views of it (`input_w.unbind(0)`, the cell's
`pre_compute_input`). No op reads the projection after the last step, yet the variable holds it:
- FullLayer (one direction): until the function returns, after `at::stack` of the step outputs;
- FullBidirectionalLayer: the forward direction's until `input_w` and `step_inputs` are given the reverse
  direction's (`input_w = params.second.linear_ih(input); step_inputs = input_w.unbind(0);`), the reverse
  direction's until the function returns, after `at::cat` of the two directions.
Against real CPU runs (`tests/test_rnn_layers.py`) a two-layer bidirectional GRU was 5.6% low without this (the
reverse direction's projection live at the `cat` in the real run), a one-direction GRU 4.5%, an LSTM without
oneDNN 6.3%; with it they are exact to 4 bytes.
Two more variables hold float32 tensors that, under autocast, no saved tensor keeps (the layers' matmuls save
bfloat16 casts of their inputs for the backward; in float32 they save the tensors themselves, live anyway):
- FullBidirectionalLayer's `fw_result.outputs` and `rev_result.outputs`, each direction's step outputs, until the
  function returns, after the `cat` (a one-direction FullLayer's `step_outputs` die at its stack, its last op);
- apply_layer_stack's `layer_input`, a layer's input past the first (the layer below's output, or `at::dropout` of it,
  `input * noise` on the CPU), until the layer it feeds returns.
Against plain runs under autocast to bfloat16 (`tests/test_rnn_layers.py`) a one-layer bidirectional GRU was 7.7% low
without them, a two-layer LSTM with dropout 3.6%.
The packed-sequence variants (PackedLayer) compute each step's projection in the step: nothing is held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest.mock import patch

import torch

from memplan.estimator.composites import CompositeOp, CompositeWatcher, watched

_UNBIND = torch.ops.aten.unbind.int
_STACK = torch.ops.aten.stack.default
_CAT = torch.ops.aten.cat.default
_MUL = torch.ops.aten.mul.Tensor
_LAYERS = ("gru", "rnn_tanh", "rnn_relu", "lstm")  # the torch._VF functions nn.GRU, nn.RNN and nn.LSTM call


def held_projections(ops: list[CompositeOp], bidirectional: bool) -> list[tuple[object, int]]:
    """(storage, the last node it lives through) for each layer's input projection, from the ops one call of the
    composite ran (module docstring). A projection is what an unbind inside the call takes apart that an op of
    the call made: the hidden states' unbind (`hx.unbind(0)`, made by the caller) is not one."""
    held: list[tuple[object, int]] = []
    for layer in _layers(ops, bidirectional):
        if layer.reverse_unbind is None:
            held.append((ops[layer.forward_unbind].argument_storage, ops[layer.end].end))
            continue
        held.append((ops[layer.forward_unbind].argument_storage, ops[layer.reverse_unbind].end))
        held.append((ops[layer.reverse_unbind].argument_storage, ops[layer.end].end))
    return held


def held_locals(
    ops: list[CompositeOp], bidirectional: bool, dropout: float = 0.0, train: bool = False
) -> list[tuple[object, int]]:
    """What one call of the composite holds in its variables past the last op that reads it (module docstring):
    each layer's input projection (`held_projections`); a bidirectional layer's step outputs, which
    `fw_result.outputs` and `rev_result.outputs` hold after each direction's stack until the layer returns, after
    its `cat`; and each layer's input past the first, `layer_input` in apply_layer_stack (the layer below's output,
    or `at::dropout` of it, where dropout applies: `dropout != 0 && train`), until the layer it feeds returns."""
    held = held_projections(ops, bidirectional)
    layers = _layers(ops, bidirectional)
    for layer in layers:
        if layer.reverse_unbind is None:
            continue
        for stack in (layer.forward_stack, layer.reverse_stack):
            if stack is not None:
                held += [(storage, ops[layer.end].end) for storage in ops[stack].argument_storages]
    for below, layer in zip(layers, layers[1:], strict=False):
        layer_input = next(iter(ops[below.end].output_storages), None)
        if dropout and train:  # Dropout.cpp's _dropout_impl on the CPU: `input * noise`
            layer_input = next(
                (
                    next(iter(op.output_storages), None)
                    for op in ops[below.end + 1 : layer.forward_unbind]
                    if op.func is _MUL and op.argument_storage == layer_input
                ),
                layer_input,
            )
        if layer_input is not None:
            held.append((layer_input, ops[layer.end].end))
    return held


@dataclass(frozen=True)
class _Layer:
    """Indices in a composite's ops of one layer's projection unbinds, its directions' stacks, and its last op
    (the stack of one direction, the `cat` of two)."""

    forward_unbind: int
    forward_stack: int | None
    reverse_unbind: int | None
    reverse_stack: int | None
    end: int


def _layers(ops: list[CompositeOp], bidirectional: bool) -> list[_Layer]:
    made_inside: set[object] = set()
    projections: list[int] = []  # index in ops of each projection's unbind
    for index, op in enumerate(ops):
        if op.func is _UNBIND and op.argument_storage in made_inside:
            projections.append(index)
        made_inside |= op.output_storages
    layers: list[_Layer] = []
    if not bidirectional:
        for unbind in projections:
            stack = _first_after(ops, unbind, _STACK)
            if stack is not None:
                layers.append(_Layer(unbind, stack, None, None, stack))
        return layers
    for forward, reverse in zip(projections[::2], projections[1::2], strict=False):
        cat = _first_after(ops, reverse, _CAT)
        if cat is not None:
            forward_stack, reverse_stack = _first_after(ops, forward, _STACK), _first_after(ops, reverse, _STACK)
            layers.append(_Layer(forward, forward_stack, reverse, reverse_stack, cat))
    return layers


def _first_after(ops: list[CompositeOp], index: int, func: Any) -> int | None:
    return next((later for later in range(index + 1, len(ops)) if ops[later].func is func), None)


def _is_packed(args: tuple[Any, ...]) -> bool:
    """`_VF.gru(data, batch_sizes, hx, params, has_biases, ...)` for a PackedSequence, where the unpacked
    form is `_VF.gru(input, hx, params, has_biases, ...)`: the fourth argument tells them apart."""
    return len(args) > 3 and isinstance(args[3], list | tuple)


@contextlib.contextmanager
def rnn_projections_tracked(watcher: CompositeWatcher) -> Iterator[None]:
    """While a step is traced, what each call of a recurrent composite held past its last use (module docstring)."""

    def held(ops: list[CompositeOp], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[object, int]]:
        if _is_packed(args):
            return []

        def argument(index: int, name: str, default: Any) -> Any:
            return args[index] if len(args) > index else kwargs.get(name, default)

        # _VF.gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
        return held_locals(
            ops,
            bool(argument(7, "bidirectional", False)),
            float(argument(5, "dropout", 0.0)),
            bool(argument(6, "train", False)),
        )

    with contextlib.ExitStack() as patches:
        for name in _LAYERS:
            patches.enter_context(patch.object(torch._VF, name, watched(watcher, getattr(torch._VF, name), held)))
        yield


@contextlib.contextmanager
def cudnn_rnn_reported(unknown_ops: set[str]) -> Iterator[None]:
    """On a cuda target: a recurrent layer runs cuDNN's fused RNN there (`_cudnn_rnn`, aten/src/ATen/native/cudnn/
    RNN.cpp, where cudnn_is_acceptable), with a training reserve space and a workspace whose sizes cuDNN chooses,
    where memplan's fake tensors, CPU tensors, run ATen's CPU layers. Reported with the estimate's unsupported ops,
    not guessed."""

    def reported(name: str, layer: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            unknown_ops.add(f"aten::_cudnn_rnn (torch.nn's {name} on CUDA; its CPU layers were traced instead)")
            return layer(*args, **kwargs)

        return run

    with contextlib.ExitStack() as patches:
        for name in _LAYERS:
            patches.enter_context(patch.object(torch._VF, name, reported(name, getattr(torch._VF, name))))
        yield
