"""Recurrent kernels: oneDNN's LSTM/GRU layer returns a workspace whose size fake tensors don't know.

The meta kernel of `aten.mkldnn_rnn_layer` returns an empty workspace (torch 2.13), while the real
CPU kernel returns oneDNN's training workspace (573,440 bytes for a 96-unit layer, batch 4, 24
steps). oneDNN sizes it from the primitive descriptor alone, so memplan asks oneDNN: it runs the
layer once on real zero tensors of the same shapes and dtypes and caches the answer.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan.estimator.oprules import output_bytes_rule


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, list | tuple):
        return tuple(_spec(item) for item in value)
    return value


def _materialize(spec: Any) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        return torch.zeros(spec[1], dtype=spec[2])
    if isinstance(spec, tuple):
        return [_materialize(item) for item in spec]
    return spec


@cache
def _probe(op: Any, arg_specs: tuple, kwarg_specs: tuple) -> tuple[int, ...]:
    with unset_fake_temporarily():
        args = [_materialize(spec) for spec in arg_specs]
        kwargs = {key: _materialize(spec) for key, spec in kwarg_specs}
        outputs = op(*args, **kwargs)
    return tuple(out.untyped_storage().nbytes() for out in outputs if isinstance(out, torch.Tensor))


@output_bytes_rule(torch.ops.aten.mkldnn_rnn_layer.default)
def mkldnn_rnn_layer(args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> list[int]:
    return list(_probe(torch.ops.aten.mkldnn_rnn_layer.default, _spec(args), tuple(sorted(_spec(kwargs).items()))))
