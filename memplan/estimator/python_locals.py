"""What a model's Python variables keep alive while its step runs: which frames' locals count (model code, not
torch's machinery or memplan's), the tensors a variable holds (itself, a container's, a Hugging Face key/value
cache's), and each frame's bindings as they change (LocalBindings). Read by memplan.estimator.eager_lifetimes at
every op."""

from __future__ import annotations

import os
import sys
import weakref
from types import FrameType

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.estimator.leaves import local_tensor, storage_key

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN_DIR = os.path.join(_TORCH_DIR, "nn") + os.sep
# torch.autograd.backward and torch.autograd.grad (torch/autograd/__init__.py, torch 2.11-2.14) make the root
# gradients (`_make_grads`: `ones_like` of a scalar loss) into the local `grad_tensors_`/`grad_outputs_`, which
# holds them until the engine returns: through the whole backward, not only to the first formula that reads them.
_TORCH_AUTOGRAD_API = os.path.join(_TORCH_DIR, "autograd", "__init__.py")
# memplan's own frames on the stack while a step is traced, whose locals are not the model's.
_TRACER_FILES = tuple(
    os.path.join(os.path.dirname(__file__), name)
    for name in (
        "eager_lifetimes.py",
        "python_locals.py",
        "trace.py",
        "held_tensors.py",
    )  # held_tensors: OptimizerLocals
)


def holds_python_locals(filename: str) -> bool:
    """Frames whose local variables can keep a model's tensors alive: model code, not torch's machinery."""
    if filename in _TRACER_FILES:
        return False
    return not filename.startswith(_TORCH_DIR) or filename.startswith(_TORCH_NN_DIR) or filename == _TORCH_AUTOGRAD_API


# Values that hold no tensor, passed over without asking what they are.
_ATOMS = (int, float, complex, str, bytes, bool, type(None))
# The most items of containers nested in a variable's value that one reading descends into (its own items are all
# read). A model's outputs nest tens of items; a script's tokenized dataset held as lists in its globals (a frame
# under the trace, read as the trace begins) nests millions: walked whole, a tiny GPT-2's estimate took 41.6 s
# instead of 2.8 s with 20,000 samples of 512 token ids (a review's measurement). A bound on time, not on bytes:
# what lies deeper in so large a structure is what one level deep had never read.
_NESTED_ITEMS_READ = 10_000


def tensors_held(value: object) -> list[torch.Tensor]:
    """The tensors a variable holding `value` keeps alive: itself, or those in it, through containers (tuples, lists,
    dicts, ModelOutput among them) nested to any depth within _NESTED_ITEMS_READ, and the keys and values of a
    Hugging Face key/value cache in one (a causal LM's output holds one where its config has `use_cache` on:
    transformers fills it in training too, with copies made by `torch.cat`, cache_utils.DynamicLayer.update).

    A model's output dict held in a variable keeps its logits alive; one holding another model's output keeps that
    one's tensors: LLaVA-NeXT's vision tower output (a BaseModelOutputWithPooling: its hidden states in a tuple, the
    packed image features in a list as its pooler_output) is held in a dict (`mm_encoder_outputs["image"]`,
    LlavaNextModel.forward) and in the model's outputs (`image_outputs`) until the loss is computed
    (modeling_llava_next.py, transformers 5.25; 5.17 keeps only the features, and lets them go as
    get_image_features returns). Read one level deep, the tower's last hidden state and the image features had been
    let go as the features were concatenated (an amp-bf16 step, whose peak is in the forward, 22,256 B low)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, _ATOMS):
        return []
    cache_type = _key_value_cache_type()  # (looked up once: a variable may hold a list of thousands of objects)
    held: list[torch.Tensor] = []
    pending: list[tuple[object, bool]] = [(value, False)]  # (an item, whether it is nested in another container)
    seen: set[int] = set()
    nested_left = _NESTED_ITEMS_READ
    while pending:
        item, nested = pending.pop()
        if isinstance(item, torch.Tensor):
            held.append(item)
        elif isinstance(item, _ATOMS):
            continue
        elif isinstance(item, tuple | list | dict):
            if nested:
                if len(item) > nested_left:
                    continue
                nested_left -= len(item)
            if id(item) in seen:  # (a container reached twice, or holding itself)
                continue
            seen.add(id(item))
            pending.extend((child, True) for child in reversed(list(item.values() if isinstance(item, dict) else item)))
        elif cache_type is not None and isinstance(item, cache_type):
            held += _key_value_cache_tensors(item, cache_type)
    return held


def _key_value_cache_type() -> type | None:
    """transformers' `Cache`, where transformers.cache_utils is imported."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return getattr(cache_utils, "Cache", None)


def _key_value_cache_tensors(value: object, cache_type: type) -> list[torch.Tensor]:
    """The tensors of a transformers `Cache` (each layer's keys, values and whatever else it keeps; an
    encoder-decoder cache's two caches)."""
    found = [
        tensor
        for layer in getattr(value, "layers", None) or ()
        for tensor in vars(layer).values()
        if isinstance(tensor, torch.Tensor)
    ]
    for inner in ("self_attention_cache", "cross_attention_cache"):
        inner_cache = getattr(value, inner, None)
        if isinstance(inner_cache, cache_type):
            found += _key_value_cache_tensors(inner_cache, cache_type)
    return found


def _gained(container: object, known: int) -> list[StorageWeakRef]:
    """The storages a container held in a variable gained since it held `known` items: a list's new tail (what a
    loop appends, read once: DeepSpeed's ZeRO-3 appends a view per rank, a thousand on a large job), a dict's
    values again. What it lost is LocalBindings.read's (_kept)."""
    if isinstance(container, list) and len(container) > known:
        return [storage_key(tensor) for item in container[known:] for tensor in tensors_held(item)]
    if isinstance(container, dict):
        return [storage_key(tensor) for tensor in tensors_held(container)]
    return []


def _kept(container: object, keys: list[StorageWeakRef]) -> tuple[list[StorageWeakRef], list[StorageWeakRef]]:
    """A container held in a variable that has fewer items than when last read (`list.pop`, `del`, `dict.pop`,
    `clear`): the storages it holds now, and those of `keys` it no longer holds, which it stops keeping alive then.
    A U-Net's `skips.pop()` hands its skip connection to `torch.cat`, after which nothing holds it where no backward
    saved it (a max pooling that autocast ran in float32 saved a float32 copy, a checkpointed block's output saved
    nothing): the list had kept it counted until the forward returned (a 3-D U-Net's checkpointed amp-bf16 step
    0.8% high)."""
    now = [storage_key(tensor) for tensor in tensors_held(container)]
    held = set(now)
    return now, [key for key in dict.fromkeys(keys) if key not in held]


class LocalBindings:
    """What one frame's variables held when last read, until each variable is bound to something else.

    `x = f(x)` keeps the old `x` alive while `f` runs, and anything the frame calls meanwhile: the variable lets go
    only when it is assigned. Reading the variables at every op of the frame (and as it calls others) tells when
    each value was bound last; the storages of one that is gone live through the op before (`release`). A value
    is known by identity: a weak reference to a tensor (none kept alive by this) and the storage it has (`.data =`
    gives it another), the id of a container and its length (what it gains or loses is read as its length changes: a
    list a loop appends to, one it pops from; one whose items are replaced in place is read as it was). Containers
    nested in one are read with it, as it is bound and as its own length changes: a tensor an inner list lets go is
    counted until then (an inner `pop` feeding a `cat` left a step 4% high, a review's example), one an inner list
    gains after that is not counted as the variable's."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        # variable -> (identity, storages, what tells a change: a tensor's storage, a container's length)
        self.held: dict[str, tuple[object, list[StorageWeakRef], int]] = {}

    def read(self, frame: FrameType, now: int, lifetimes: list[tuple[StorageWeakRef, int]]) -> None:
        """The frame's variables at an op: a value bound since the last read replaces one that lived until `now`."""
        current = frame.f_locals
        for name in [name for name in self.held if name not in current]:  # a `del`
            lifetimes.extend((key, now) for key in self.held.pop(name)[1])
        held = self.held
        for name, value in current.items():
            entry = held.get(name)
            if entry is not None:
                identity, keys, mark = entry
                if isinstance(identity, int):  # a container: the same one holds what it held, and what it gained
                    if identity == id(value):
                        if len(value) < mark:  # type: ignore[arg-type]
                            keys, lost = _kept(value, keys)
                            lifetimes.extend((key, now) for key in lost)
                            held[name] = (identity, keys, len(value))  # type: ignore[arg-type]
                        elif mark != len(value):  # type: ignore[arg-type]
                            held[name] = (identity, keys + _gained(value, mark), len(value))  # type: ignore[arg-type]
                        continue
                elif (
                    isinstance(value, torch.Tensor)  # a dead tensor's weak reference answers None, as `x = None` binds
                    and identity() is value
                    and mark == local_tensor(value).untyped_storage()._cdata
                ):
                    continue  # the same tensor on the same storage (`.data =` gives it another)
                lifetimes.extend((key, now) for key in keys)
                del held[name]
            if isinstance(value, torch.Tensor):
                held[name] = (weakref.ref(value), [storage_key(value)], local_tensor(value).untyped_storage()._cdata)
            elif isinstance(
                value, tuple | list | dict
            ):  # kept even without tensors: read again when its length changes
                held[name] = (id(value), [storage_key(tensor) for tensor in tensors_held(value)], len(value))

    def release(self, end: int, lifetimes: list[tuple[StorageWeakRef, int]]) -> None:
        """The frame has returned (or the step ended): what its variables held lived through `end`."""
        for _, keys, _ in self.held.values():
            lifetimes.extend((key, end) for key in keys)
        self.held.clear()
