"""FakeTensorMode's cache keys, made faster for the fake tensors a trace passes: the same key, element for element.

FakeTensorMode caches each op's output metadata under a key made of the op and its arguments, each fake tensor
argument flattened into its metadata (torch/_subclasses/fake_tensor.py: `_prep_args_for_hash`, which builds a
`TensorMetadata` with `extract_tensor_metadata` and flattens it field by field with `_flatten_into`, recursing into
the sizes and strides). On a warm cache that key was a fifth of a trace's time (py-spy at 200 samples a second over
warm traces in one process, as `PYTHONPATH=<the tree at e986def> py-spy record -r 200 -f raw -- python
benchmarks/warm_trace.py gpt2 resnet-50 --rounds 10` repeats them: 20.5% and 20.8% in `_cache_key`; the cached
outputs' construction another 12-16%, memplan.estimator.fake_cache_outputs), most of it in the generic machinery
around a plain tensor's few fields: the dataclass, its `fields()`, four sparse-layout tests, a recursion with its
imports for each size tuple.

`prep_args_for_hash` writes what torch writes for a fake tensor of the mode with a strided layout, concrete sizes,
strides, offset and storage size, and no constant (every tensor memplan traces with), and for plain numbers,
strings, dtypes and devices and the lists, tuples and dicts of them; anything else (a SymInt, a view on a storage of
symbolic size, a tensor of another mode, a function...) goes to torch's own function, one argument at a time, so
that its checks and its reasons to bypass the cache stay torch's. Keys equal torch's (tests/test_fake_cache_keys.py
builds both over the same arguments), so entries are shared with, and answered to, any FakeTensorMode in the process
as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses import fake_tensor

# Values torch's `_prep_args_for_hash` writes as their type and themselves (its last branch).
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def prep_args_for_hash(
    mode: Any,
    torch_s: Callable[[list[object], Any, Any, list[object]], None],
    result: list[object],
    args: Any,
    state: Any,
    id_hashed_objects: list[object],
) -> None:
    """torch's FakeTensorMode._prep_args_for_hash for `mode` (module docstring); `torch_s` is torch's own, called for
    each argument this does not write itself."""
    if isinstance(args, list | tuple | dict):
        result.append(type(args))
        result.append(f"length_{len(args)}")
    if isinstance(args, dict):
        prep_args_for_hash(mode, torch_s, result, args.keys(), state, id_hashed_objects)
        prep_args_for_hash(mode, torch_s, result, args.values(), state, id_hashed_objects)
        return
    for arg in args:
        kind = type(arg)
        if kind in _PLAIN:
            result.append(kind)
            result.append(arg)
        elif kind is fake_tensor.FakeTensor and _plain_fake(mode, arg):
            if not _flatten_metadata(result, arg):
                torch_s(result, iter((arg,)), state, id_hashed_objects)
        elif kind is list or kind is tuple or kind is torch.Size:
            prep_args_for_hash(mode, torch_s, result, arg, state, id_hashed_objects)
        else:  # one argument, passed as an iterator: torch adds no container marks for it
            torch_s(result, iter((arg,)), state, id_hashed_objects)


def _plain_fake(mode: Any, tensor: Any) -> bool:
    """A fake tensor of `mode` whose key _flatten_metadata writes: torch would neither bypass the cache for it (another
    mode's, a constant, a sparse layout) nor convert a symbolic size."""
    return (
        tensor.fake_mode is mode
        and tensor.constant is None
        and tensor.layout is torch.strided
        and not tensor._has_symbolic_sizes_strides
    )


def _flatten_metadata(result: list[object], tensor: torch.Tensor) -> bool:
    """What `extract_tensor_metadata(tensor)._flatten_into(result, ...)` writes for a plain fake tensor: the fields in
    TensorMetadata's order, the sizes (a torch.Size) and strides (a tuple) as torch writes a container, each size a
    type and a value; the sparse fields False and None. False, with nothing written, where its storage offset or size
    is symbolic."""
    shape = tensor.shape
    stride = tensor.stride()
    offset = tensor.storage_offset()
    storage_bytes = tensor.untyped_storage().nbytes()
    if type(offset) is not int or type(storage_bytes) is not int:
        return False  # a view of concrete sizes on a storage of symbolic size: torch's to write (convert_sym_int)
    # suggest_memory_format (torch/_prims_common, torch 2.11-2.14) tells a channels-last layout from the strides of a
    # 4-d or 5-d tensor only; of any other strided tensor it says contiguous_format.
    memory_format = fake_tensor.suggest_memory_format(tensor) if len(shape) in (4, 5) else torch.contiguous_format
    if not tensor.is_contiguous(memory_format=memory_format):
        memory_format = None
    result.append(tensor.dtype)
    result.append(type(shape))
    result.append(f"length_{len(shape)}")
    for size in shape:
        result.append(int)
        result.append(size)
    result.append(type(stride))
    result.append(f"length_{len(stride)}")
    for step in stride:
        result.append(int)
        result.append(step)
    result.append(tensor.device)
    result.append(torch.strided)
    result.append(memory_format)
    result.append(offset)
    result.append(storage_bytes)
    result.append(tensor.requires_grad)
    result.append(tensor.is_quantized)
    result.append(tensor.is_conj())
    result.append(tensor.is_neg())
    result.append(tensor.is_inference())
    result.append(False)  # is_sparse
    result.append(None)  # is_coalesced
    result.append(None)  # dense_dim
    result.append(None)  # sparse_dim
    return True
