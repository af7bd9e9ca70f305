"""Scratch of oneDNN's LSTM layers on the CPU (`mkldnn_rnn_layer` and its backward, aten/src/ATen/native/mkldnn/
RNN.cpp, torch 2.11-2.14): each call reorders the weights into oneDNN's packed layouts, gives the primitive its
scratchpad, and (backward) copies a strided output gradient contiguous and makes zeros for the undefined gradients
of the final states, all inside the kernel, where no dispatch mode sees. The sizes are oneDNN's choice for the
primitive descriptor, so memplan asks oneDNN, as for the layer's workspace (memplan.estimator.oprules.rnn): it runs
the call once on real zeros of the same shapes, strides and dtypes and reads the CPU allocator's events. A forward
LSTM layer of 40 units (batch 4, 20 steps, 24 features) holds 107,704 B so, its backward 158,904 B (171,704 B for
the transposed output gradient of a batch-first layer): missing, a step's prediction was 32% low.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.composite_kernels import composite_kernel_scratch
from memplan.estimator.oprules.rnn import kernel_run


def _scratch(op: Any) -> Any:
    def rule(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
        if device != "cpu":  # a cuda target's recurrent layers are cuDNN's (memplan.estimator.rnn_layers)
            return 0
        held = kernel_run(op, args, kwargs).held_beside_outputs
        # None: a profiler already ran in this process as memplan asked (profilers cannot nest), which an estimate's
        # own process never has; a caller measuring the step under its own profiler sees this scratch in its events
        return held if held is not None else 0

    return composite_kernel_scratch(op)(rule)


_scratch(torch.ops.aten.mkldnn_rnn_layer.default)
_scratch(torch.ops.aten.mkldnn_rnn_layer_backward.default)
