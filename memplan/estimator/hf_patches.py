"""Make transformers take, under fake tensors, the same code path a real run takes (design.md §3).

transformers checks tensor *values* in a few places and, seeing a fake tensor, assumes the worst:
`find_packed_sequence_indices` keeps a packed-sequence mask (a real run of an unpacked batch gets
None and SDPA's is_causal path), which changed Llama's attention path and its memory. And rotary
embeddings whose frequencies depend on the sequence (`dynamic_rope_update`: longrope, as Phi-3's,
and the dynamic types) compare the largest position with a length in Python on some transformers
releases (5.17: `if seq_len > original_max_position_embeddings`), which a fake tensor cannot
answer; under fake tensors they run without that update, which picks between frequency tables of
the same size, so memory is unchanged.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator, Mapping, Sequence
from types import CellType, ModuleType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memplan.estimator.causal_masks import causal_masks_read
from memplan.estimator.input_checks import input_checks_passing
from memplan.estimator.known_values import tensors_of_values
from memplan.estimator.layer_drop import layers_never_dropped
from memplan.estimator.model_modules import found_in_model_modules
from memplan.estimator.padding_images import no_padding_images


@contextlib.contextmanager
def real_run_paths(
    producers: Mapping[torch.Tensor, Any] | None = None, recorded: Sequence[Any] | None = None
) -> Iterator[None]:
    """`producers` (the recorder's tensor -> the graph node that made it): where given, a padding mask the model made
    of ones is known to be one (_causal_mask_skipped_for_ones), and with `recorded` (the recorder's nodes, in order)
    torch's transformer modules read a mask made of constants as the real run reads it
    (memplan.estimator.causal_masks). Input checks that read values pass (memplan.estimator.input_checks), and a CTC
    head's loss reads the values memplan's own labels have (memplan.estimator.known_values, as torch.tensor of
    fake tensors with values does); LayerDrop's
    draws keep every layer (memplan.estimator.layer_drop); `torch.tensor` of fake tensors that carry values is
    made of them (memplan.estimator.known_values); Idefics3's padding images are none, as in memplan's batch
    (memplan.estimator.padding_images)."""
    with (
        _rope_without_frequency_updates(),
        input_checks_passing(),
        causal_masks_read(producers, recorded),
        layers_never_dropped(),
        tensors_of_values(),
        no_padding_images(),
    ):
        masking = sys.modules.get("transformers.masking_utils")
        if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
            yield
            return
        with _unpacked_sequences(masking), _causal_mask_skipped_for_ones(masking, producers):
            yield


_ONES = frozenset({torch.ops.aten.ones.default, torch.ops.aten.ones_like.default, torch.ops.aten.new_ones.default})
# Ops that keep every value of their input (a cast to bool of ones is all True; a view or a slice of them too).
_SAME_VALUES = frozenset(
    {
        torch.ops.aten._to_copy.default,
        torch.ops.aten.view.default,
        torch.ops.aten.expand.default,
        torch.ops.aten.slice.Tensor,
        torch.ops.aten.unsqueeze.default,
        torch.ops.aten.clone.default,
    }
)


def made_of_ones(tensor: torch.Tensor, producers: Mapping[torch.Tensor, Any]) -> bool:
    """Whether the graph made `tensor` from ones through ops that keep values: all ones (all True)."""
    node = producers.get(tensor)
    while node is not None and getattr(node, "target", None) in _SAME_VALUES:
        source = node.args[0] if node.args else None
        node = source if hasattr(source, "target") else None
    if node is None:
        return False
    target = getattr(node, "target", None)
    return target in _ONES or (target is torch.ops.aten.full.default and len(node.args) > 1 and node.args[1] == 1)


@contextlib.contextmanager
def _causal_mask_skipped_for_ones(masking: Any, producers: Mapping[torch.Tensor, Any] | None) -> Iterator[None]:
    """transformers skips the causal mask for SDPA's `is_causal` where the padding mask has no padding
    (masking_utils._ignore_causal_mask_sdpa), but takes any fake tensor for a traced graph (`is_tracing`) and
    builds the mask. BART's decoder (and mBART's, Pegasus', Marian's) makes its padding mask itself, `torch.ones`,
    where none is given: a real run skips the mask, the trace built a float [batch, 1, target, target] one per layer
    and kept it (+0.5-0.8% on a tiny BART against its real CPU run, a helper's bug hunt). A padding mask the graph
    made of ones is read as none; so is one whose values the trace keeps (memplan.estimator.known_values), all true.
    The same for the bidirectional mask (`_ignore_bidirectional_mask_sdpa`, 5.17-5.25): Idefics3's and SmolVLM's
    vision tower is given the patches' mask, all true in memplan's batch (memplan.models.vision_language_tiles), which
    a real run skips and the trace had built, a float [images, 1, patches, patches] mask, +1.4% on a tiny Idefics3."""
    originals = {
        name: getattr(masking, name, None) for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    }
    if producers is None:
        yield
        return

    def ignoring(original: Any) -> Any:
        def ignore_mask(padding_mask: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(padding_mask, FakeTensor) and (
                made_of_ones(padding_mask, producers) or _kept_all_true(padding_mask)
            ):
                padding_mask = None
            return original(padding_mask, *args, **kwargs)

        return ignore_mask

    for name, original in originals.items():
        if original is not None:
            setattr(masking, name, ignoring(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(masking, name, original)


def _kept_all_true(mask: FakeTensor) -> bool:
    """Whether the trace keeps `mask`'s values (memplan.estimator.known_values) and all are true (or non-zero)."""
    values = mask.constant
    return (
        getattr(mask.fake_mode, "keeps_values", False)
        and isinstance(values, torch.Tensor)
        and values.shape == mask.shape
        and bool(values.all())
    )


@contextlib.contextmanager
def _rope_without_frequency_updates() -> Iterator[None]:
    """In every loaded rotary-embedding class that transformers' dynamic_rope_update decorates, the
    frequency updates its wrapper calls (closure cells `longrope_frequency_update`,
    `dynamic_frequency_update`) are skipped for fake positions."""
    replaced: list[tuple[Any, Any]] = []  # (closure cell, original update)
    seen: set[int] = set()
    for cell in found_in_model_modules(_frequency_update_cells):  # (each module read once)
        if id(cell) in seen:
            continue
        seen.add(id(cell))
        replaced.append((cell, cell.cell_contents))
        cell.cell_contents = _skipped_for_fake_positions(cell.cell_contents)
    try:
        yield
    finally:
        for cell, update in replaced:
            cell.cell_contents = update


def _frequency_update_cells(name: str, module: ModuleType) -> list[CellType]:
    """The closure cells of the frequency updates of the dynamic_rope_update wrappers on the forwards of one modeling
    module's classes."""
    cells = []
    for value in list(vars(module).values()):
        # Looked up statically: a modeling module imported without one of its backends (an image processor's module
        # without torchvision) holds transformers' placeholder classes, whose metaclass (DummyObject) raises ImportError
        # at any attribute asked of them, and failed every later trace in the process.
        forward = inspect.getattr_static(value, "forward", None) if isinstance(value, type) else None
        wrapper = _rope_update_wrapper(forward)
        if wrapper is None:
            continue
        for variable, cell in zip(wrapper.__code__.co_freevars, wrapper.__closure__ or (), strict=True):
            if variable in ("longrope_frequency_update", "dynamic_frequency_update"):
                cells.append(cell)
    return cells


def _rope_update_wrapper(function: Any) -> Any:
    """dynamic_rope_update's wrapper in a chain of decorators (torch.no_grad's among them), or None;
    functools.wraps gives it the forward's own names, its code keeps where it was defined."""
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is not None and code.co_name == "wrapper" and code.co_filename.endswith("modeling_rope_utils.py"):
            return function
        function = getattr(function, "__wrapped__", None)
    return None


def _skipped_for_fake_positions(update: Any) -> Any:
    def maybe_update(self: Any, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if isinstance(position_ids, FakeTensor):
            return None  # picks between frequency tables of one size: no memory to predict
        return update(self, position_ids, *args, **kwargs)

    return maybe_update


@contextlib.contextmanager
def _unpacked_sequences(masking: Any) -> Iterator[None]:
    original = masking.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor):
            # memplan's batches are never packed: the real check returns None for them.
            return None
        return original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


@contextlib.contextmanager
def no_weight_init() -> Iterator[None]:
    """Make torch.nn.init's in-place initialisers no-ops while building under fake tensors.

    Initialisation only sets values, which fake tensors don't have, and some initialisers branch on
    them (`trunc_normal_` loops until no sample is rejected).
    """
    import torch.nn.init as init

    originals = {
        name: getattr(init, name)
        for name in dir(init)
        if name.endswith("_") and not name.startswith("_") and callable(getattr(init, name))
    }
    hf_table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    hf_originals = dict(hf_table) if isinstance(hf_table, dict) else {}

    def keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        # the initialiser would have written the tensor: a factory reading it back gets no stale constant value
        tracker = getattr(getattr(tensor, "fake_mode", None), "constants", None)
        if tracker is not None:
            tracker.written(tensor)
        return tensor

    for name in originals:
        setattr(init, name, keep)
    for name in hf_originals:
        hf_table[name] = keep  # type: ignore[index]
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(init, name, function)
        for name, function in hf_originals.items():
            hf_table[name] = function  # type: ignore[index]
