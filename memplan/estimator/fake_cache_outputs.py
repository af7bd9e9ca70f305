"""FakeTensorMode's cached outputs, built faster for the plain tensors a trace makes: the same tensors.

On a cache hit FakeTensorMode builds each output afresh from the entry's metadata (torch/_subclasses/fake_tensor.py:
`_get_output_tensor_from_cache_entry`): it reads each size, stride and the offset through a closure that would resolve
a symbolic one, makes an empty meta tensor inside `in_kernel_invocation_manager` and `nullcontext` (two
generator-based context managers), sets a view's storage, and wraps the meta tensor with `FakeTensor(mode, meta,
device)`, whose `__new__` validates its arguments, normalizes the device (on a machine with the device, making a
one-element tensor there each time: `init_gpu_context`) and sets twenty-one attributes one by one on torch 2.13 (five
memo descriptors, three attributes each). With memplan's cache keys (fake_cache_keys) that construction was the
largest part left of a warm trace's fake dispatch (py-spy at 200 samples a second over twenty warm traces in one
process, as `PYTHONPATH=<the tree at 920e4bc> py-spy record -r 200 -f raw -- python benchmarks/warm_trace.py gpt2
--rounds 20` repeats them: 18% of a trace under `_output_from_cache_entry`, 7.5% of it in `FakeTensor.__new__`).

`FreshOutputs.built` builds the same tensor for an entry of a mode without a ShapeEnv whose metadata is a strided
tensor neither conjugated nor negated: the meta tensor made with torch's arguments under the guard that turns Python
dispatch off (what in_kernel_invocation_manager enters; the meta tensor's own kernels need no more), a view set onto
its argument's storage as torch sets it, and the wrapper made as `FakeTensor.__new__` makes it
(`Tensor._make_subclass` with the fake device, the mutable-data-pointer check torch sets), its attributes copied from
a tensor that torch's own constructor made for the mode and device (so they are whatever this torch sets; that
construction is the one that checks the device and readies a real one). Not run: `FakeTensor.__init__`, which only
tracks tensors made while torch.export runs, so an export (which memplan never runs) is left to torch, as are entries
on the meta device (torch refuses them unless the mode allows meta) and anything else.
tests/test_fake_cache_outputs.py compares the two tensors, attribute by attribute, over plain, view and multi-output
entries (with either data-pointer flag, and under inference mode), checks what is left to torch, that an entry torch's
own FakeTensorMode cached answers memplan's mode, and runs whole steps under torch's own cache crosscheck (each hit
dispatched again through the fake kernel and compared).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig


class FreshOutputs:
    """One mode's cached outputs built directly (`built`), with the attributes torch's FakeTensor constructor gave a
    fresh fake tensor of the mode on each device, and the device it normalized that to."""

    __slots__ = ("_by_device", "_mode")

    def __init__(self, mode: Any) -> None:
        self._mode = mode
        self._by_device: dict[torch.device, tuple[torch.device, dict[str, object]]] = {}

    def _made_by_torch(self, device: torch.device) -> tuple[torch.device, dict[str, object]]:
        known = self._by_device.get(device)
        if known is None:
            with torch._C._DisableTorchDispatch():
                meta = torch.empty(0, device="meta")
            made = FakeTensor(self._mode, meta, device)
            known = self._by_device[device] = (made.fake_device, dict(made.__dict__))
        return known

    def built(self, entry: Any, func: Any, args: Any) -> FakeTensor | None:
        """The output FakeTensorMode would build from one output's cache entry (module docstring); None where torch's
        own `_get_output_tensor_from_cache_entry` is to build it (a constant or in-place output among them)."""
        mode, metadata = self._mode, entry.metadata
        if metadata is None or entry.inplace_idx is not None or mode.shape_env is not None or FakeTensorConfig.debug:
            return None
        if metadata.layout is not torch.strided or metadata.is_conj or metadata.is_neg:
            return None
        if metadata.device.type == "meta" or not isinstance(func, OpOverload) or torch.compiler.is_exporting():
            return None
        device, attributes = self._made_by_torch(metadata.device)
        shape, stride = metadata.shape, metadata.stride
        with torch._C._DisableTorchDispatch():
            meta = torch.empty_strided(
                shape, stride, dtype=metadata.dtype, device="meta", requires_grad=metadata.requires_grad
            )
            if func.is_view:  # its storage is its argument's (torch sets it so)
                view_arg = args[entry.view_idx]
                if not isinstance(view_arg, FakeTensor):
                    return None
                meta.set_(view_arg.untyped_storage(), metadata.storage_offset, shape, stride)
        made = torch.Tensor._make_subclass(
            FakeTensor, meta, meta.requires_grad, dispatch_device=True, device_for_backend_keys=device
        )
        if not mode._allow_unsafe_data_ptr_access:
            torch._C._set_throw_on_mutable_data_ptr(made)
        else:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(made)
        made.__dict__.update(attributes)
        return made
