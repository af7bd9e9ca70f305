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
The packed-sequence variants (PackedLayer) compute each step's projection in the step: nothing is held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import patch

import torch

from memplan.estimator.composites import CompositeOp, CompositeWatcher, watched

_UNBIND = torch.ops.aten.unbind.int
_STACK = torch.ops.aten.stack.default
_CAT = torch.ops.aten.cat.default
_LAYERS = ("gru", "rnn_tanh", "rnn_relu", "lstm")  # the torch._VF functions nn.GRU, nn.RNN and nn.LSTM call


def held_projections(ops: list[CompositeOp], bidirectional: bool) -> list[tuple[object, int]]:
    """(storage, the last node it lives through) for each layer's input projection, from the ops one call of the
    composite ran (module docstring). A projection is what an unbind inside the call takes apart that an op of
    the call made: the hidden states' unbind (`hx.unbind(0)`, made by the caller) is not one."""
    made_inside: set[object] = set()
    projections: list[tuple[object, int]] = []  # (storage, index in ops) of each projection's unbind
    for index, op in enumerate(ops):
        if op.func is _UNBIND and op.argument_storage in made_inside:
            projections.append((op.argument_storage, index))
        made_inside |= op.output_storages
    held: list[tuple[object, int]] = []
    if not bidirectional:
        for storage, index in projections:
            stack = _first_after(ops, index, _STACK)
            if stack is not None:
                held.append((storage, stack))
        return held
    for forward, reverse in zip(projections[::2], projections[1::2], strict=False):
        held.append((forward[0], ops[reverse[1]].end))
        cat = _first_after(ops, reverse[1], _CAT)
        if cat is not None:
            held.append((reverse[0], cat))
    return held


def _first_after(ops: list[CompositeOp], index: int, func: Any) -> int | None:
    return next((op.end for op in ops[index + 1 :] if op.func is func), None)


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
        return held_projections(ops, bool(args[7] if len(args) > 7 else kwargs.get("bidirectional", False)))

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
