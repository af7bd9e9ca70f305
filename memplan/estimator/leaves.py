"""The leaves of nested tuples, lists and dicts: op arguments, outputs, batches."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from memplan.errors import SettingsError


def tensors_in(value: object) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def map_leaves(value: Any, leaf_type: type | tuple[type, ...], fn: Callable[[Any], Any]) -> Any:
    """`value` with every leaf of `leaf_type` replaced by `fn(leaf)`, containers rebuilt as they were.

    A plain recursion rather than torch's pytree.tree_map_only: it runs for every recorded op.
    """
    if isinstance(value, leaf_type):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(map_leaves(item, leaf_type, fn) for item in value)
    if isinstance(value, dict):
        return {key: map_leaves(item, leaf_type, fn) for key, item in value.items()}
    return value


# Tensor subclasses that wrap a local tensor and run each op on it (torch's DTensor, registered by
# memplan.distributed.fsdp when FSDP2 is traced). memplan's dispatch modes return NotImplemented for
# their ops, so the subclass runs and its ops on local tensors reach the modes: those are what
# allocate. Empty unless a trace used one, so the check costs one truth test per op otherwise.
WRAPPER_SUBCLASSES: set[type] = set()


def wraps_local_tensors(types: object) -> bool:
    """Whether an op's argument `types` (as __torch_dispatch__ receives them) include a wrapper subclass."""
    return bool(WRAPPER_SUBCLASSES) and not WRAPPER_SUBCLASSES.isdisjoint(types)  # type: ignore[arg-type]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds the memory: a wrapper subclass's local tensor, a vmap BatchedTensor's unwrapped one (one
    level of `torch.vmap` each: functorch's BatchedTensorImpl has no storage, "Cannot access storage of
    BatchedTensorImpl", and holds the tensor its batching rules run on; a model frame's variable holds one while
    transformers builds an attention mask from mask functions, masking_utils.sdpa_mask's `_vmap_expansion_sdpa`), else
    the tensor itself."""
    if type(tensor) in WRAPPER_SUBCLASSES:
        return tensor._local_tensor  # type: ignore[attr-defined]
    while torch._C._functorch.is_batchedtensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


class SparseTensorRefused(Exception):
    """An op read or made a sparse tensor (`taken`: read it, or autograd saved it for the op's backward; else made
    it: F.embedding(sparse=True)'s gradient; `func` None where no dispatch names it). Its memory is its indices' and
    values' storages, none of its own: memplan, which keys every tensor by its storage, had failed with torch's
    "Cannot access storage of SparseTensorImpl", blamed on the batch or the backward
    (memplan.estimator.trace_errors says what it is instead)."""

    def __init__(self, func: object, layout: torch.layout, taken: bool) -> None:
        super().__init__(f"{func} {'takes' if taken else 'makes'} a {layout} tensor")
        self.func, self.layout, self.taken = func, layout, taken


def refuse_sparse_tensors(model: torch.nn.Module) -> None:
    """Raise SettingsError for a sparse parameter or buffer (a graph's adjacency for torch.sparse.mm), used by the step
    or not: memplan counts every tensor by its storage (SparseTensorRefused). A model object's would have been copied
    as a dense tensor of its full shape (memplan.models.objects.skeleton: a 64-node ring's 1,280 B adjacency as
    16,384 B); a factory's, unread, failed as an internal error where the trace sorted the model's storages."""
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if tensor.layout in SPARSE_LAYOUTS:
            raise SettingsError(
                f"{name} is a sparse tensor ({tensor.layout}), which memplan does not model (it counts memory by "
                "each tensor's storage, and a sparse tensor's is its indices' and values'): pass a model that keeps "
                "its tensors dense"
            )


def storage_key(tensor: torch.Tensor) -> StorageWeakRef:
    """The key of the storage that holds the tensor's memory (its local tensor's, for a wrapper subclass)."""
    if tensor.layout in SPARSE_LAYOUTS:
        raise SparseTensorRefused(None, tensor.layout, taken=True)
    return StorageWeakRef(local_tensor(tensor).untyped_storage())
