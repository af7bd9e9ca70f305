"""memplan.estimator.fake_cache_outputs: the outputs memplan's fake mode builds from a cache entry are the tensors
torch builds from it (truth: torch's FakeTensorMode._get_output_tensor_from_cache_entry on the same mode, entry and
arguments; and torch's own cache crosscheck, which dispatches each cached op again and compares)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    _CacheKeyState,
    _DispatchCacheValidEntry,
)

from memplan.estimator.fake_cache_outputs import FreshOutputs
from memplan.estimator.fake_mode import TracingFakeMode
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

aten = torch.ops.aten


def _entry(mode: TracingFakeMode, func: object, args: tuple, kwargs: dict) -> tuple[_CacheKeyState, object, object]:
    """The op run under the mode (so that its output is cached), then its cache entry, looked up as torch looks it
    up."""
    with mode:
        func(*args, **kwargs)  # type: ignore[operator]
    state = _CacheKeyState(mode.shape_env)
    key = mode._cache_key(state, func, args, kwargs)
    entry = FakeTensorMode.cache[key]
    assert isinstance(entry, _DispatchCacheValidEntry), entry
    return state, key, entry


def _observed(tensor: object) -> dict[str, object]:
    """All a fake tensor shows: its Python attributes, layout, what autograd sees, its dispatch keys, its storage."""
    assert type(tensor) is FakeTensor
    return {
        "attributes": dict(tensor.__dict__),
        "sizes": tuple(tensor.shape),
        "strides": tensor.stride(),
        "offset": tensor.storage_offset(),
        "dtype": tensor.dtype,
        "device": tensor.device,
        "layout": tensor.layout,
        "memory format": torch.channels_last if tensor.is_contiguous(memory_format=torch.channels_last) else None,
        "requires grad": tensor.requires_grad,
        "leaf": tensor.is_leaf,
        "version": None if tensor.is_inference() else tensor._version,  # (an inference tensor has none)
        "inference": tensor.is_inference(),
        "dispatch keys": torch._C._dispatch_key_set(tensor),
        "storage bytes": tensor.untyped_storage().nbytes(),
        "storage device": tensor.untyped_storage().device,
    }


def _storage_owner(tensor: torch.Tensor, args: tuple) -> int | None:
    """Which argument's storage the tensor's is (None: a storage of its own)."""
    storage = tensor.untyped_storage()._cdata
    owners = [
        i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor) and arg.untyped_storage()._cdata == storage
    ]
    return owners[0] if owners else None


def _cases(mode: TracingFakeMode) -> dict[str, tuple[Callable, tuple, dict]]:
    with mode:
        matrix = torch.empty(4, 6)
        images = torch.empty(2, 3, 5, 7).to(memory_format=torch.channels_last)
        on_cuda = torch.empty(8, 16, dtype=torch.bfloat16, device="cuda")
        weight = torch.empty(6)
    return {
        "elementwise": (aten.add.Tensor, (matrix, matrix), {}),
        "matmul on a cuda device, bfloat16": (aten.mm.default, (on_cuda, on_cuda.t()), {}),
        "channels last": (aten.mul.Tensor, (images, 2.0), {}),
        "a transposed view": (aten.t.default, (matrix,), {}),
        "a view with an offset": (aten.slice.Tensor, (matrix, 1, 2, 5), {}),
        "an expanded view": (aten.expand.default, (weight, [4, 6]), {}),
        "an empty output": (aten.slice.Tensor, (matrix, 0, 4, 4), {}),
        "three outputs": (aten.native_layer_norm.default, (matrix, [6], weight, weight, 1e-5), {}),
        "values and indices": (aten.max.dim, (matrix, 1), {}),
        "a copy, channels last to contiguous": (
            aten.clone.default,
            (images,),
            {"memory_format": torch.contiguous_format},
        ),
    }


@pytest.mark.parametrize(
    ("unsafe_data_pointers", "inference"),
    [(True, False), (False, False), (True, True)],
    ids=["torch's default", "data pointers refused", "inference mode"],
)
@pytest.mark.parametrize("case", list(_cases(TracingFakeMode())))
def test_a_cached_output_is_the_tensor_torch_builds(case, unsafe_data_pointers, inference, monkeypatch):
    """`unsafe_data_pointers`: the mode's `_allow_unsafe_data_ptr_access` (torch's config, True by default), which
    picks the C++ flag each output gets; `inference`: both built under torch.inference_mode."""
    mode = TracingFakeMode()
    mode._allow_unsafe_data_ptr_access = unsafe_data_pointers
    func, args, kwargs = _cases(mode)[case]
    state, key, entry = _entry(mode, func, args, kwargs)

    # What torch's constructor sets on the tensor in C++ (shown to Python by nothing else): memplan's must set it too.
    flagged: dict[str, list[tuple[str, int]]] = {"memplan": [], "torch": []}
    side = "memplan"
    torch_s = {
        name: getattr(torch._C, name)
        for name in ("_set_throw_on_mutable_data_ptr", "_set_warn_deprecated_on_mutable_data_ptr")
    }
    for name in torch_s:

        def flag(tensor: torch.Tensor, name: str = name) -> None:
            flagged[side].append((name, id(tensor)))
            torch_s[name](tensor)

        monkeypatch.setattr(torch._C, name, flag)
    for info in entry.output_infos:
        with torch.inference_mode(inference):
            side = "memplan"
            ours = mode._fresh_outputs.built(info, func, args)
            assert ours is not None, "built by memplan, not left to torch"
            side = "torch"
            theirs = FakeTensorMode._get_output_tensor_from_cache_entry(mode, state, info, key, func, args)
        assert _observed(ours) == _observed(theirs)
        assert _storage_owner(ours, args) == _storage_owner(theirs, args)
        assert ours.untyped_storage()._cdata != theirs.untyped_storage()._cdata or func.is_view
        (ours_set, ours_flagged), (torch_set, torch_flagged) = flagged["memplan"][-1], flagged["torch"][-1]
        assert ours_set == torch_set and (ours_flagged, torch_flagged) == (id(ours), id(theirs))


def test_in_place_and_symbolic_outputs_are_left_to_torch():
    mode = TracingFakeMode()
    with mode:
        matrix = torch.empty(4, 6)
    _, _, entry = _entry(mode, aten.add_.Tensor, (matrix, matrix), {})
    (info,) = entry.output_infos
    assert info.inplace_idx == 0 and mode._fresh_outputs.built(info, aten.add_.Tensor, (matrix,)) is None
    with mode:
        assert matrix.add_(matrix) is matrix  # torch's own path returns the argument itself

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    symbolic = TracingFakeMode(shape_env=ShapeEnv())
    with symbolic:
        other = torch.empty(4, 6)
    _, _, entry = _entry(symbolic, aten.add.Tensor, (other, other), {})
    assert symbolic._fresh_outputs.built(entry.output_infos[0], aten.add.Tensor, (other,)) is None


def test_meta_debug_and_export_outputs_are_left_to_torch(monkeypatch):
    """torch checks a meta output against the mode's allow_meta in its constructor, records a traceback for each
    tensor in its debug mode, and tracks tensors made during torch.export in FakeTensor.__init__: each stays torch's."""
    mode = TracingFakeMode()
    mode.allow_meta = True  # (torch's config: fake_tensor_allow_meta)
    with mode:
        on_meta = torch.empty(4, 6, device="meta")
    _, _, entry = _entry(mode, aten.add.Tensor, (on_meta, on_meta), {})
    assert mode._fresh_outputs.built(entry.output_infos[0], aten.add.Tensor, (on_meta,)) is None
    with mode:
        matrix = torch.empty(4, 6)
    _, _, entry = _entry(mode, aten.add.Tensor, (matrix, matrix), {})
    (info,) = entry.output_infos
    assert mode._fresh_outputs.built(info, aten.add.Tensor, (matrix,)) is not None
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert mode._fresh_outputs.built(info, aten.add.Tensor, (matrix,)) is None
    monkeypatch.undo()
    monkeypatch.setattr(FakeTensorConfig, "debug", True)
    assert mode._fresh_outputs.built(info, aten.add.Tensor, (matrix,)) is None


def test_an_entry_torch_s_own_mode_cached_answers_memplan_s_mode_with_its_own_tensors():
    FakeTensorMode.cache_clear()
    with FakeTensorMode():
        torch.empty(3, 5).mul(torch.empty(3, 5)).t()
    mode = TracingFakeMode()
    hits = FakeTensorMode.cache_hits
    with mode:
        base = torch.empty(3, 5)
        product = base.mul(base)
        view = product.t()
    assert FakeTensorMode.cache_hits == hits + 3  # empty, mul, t
    assert product.fake_mode is mode and view.fake_mode is mode and product.shape == (3, 5)
    assert view.untyped_storage()._cdata == product.untyped_storage()._cdata and view.stride() == (1, 5)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_a_traced_step_passes_torch_s_cache_crosscheck(target, monkeypatch):
    """torch's crosscheck (cache_crosscheck_enabled, for testing) runs each op answered from the cache again through
    its fake kernel and compares the two outputs' metadata: every output memplan built in a whole step is checked."""
    spec = resolve_model("tiny-gpt2")
    settings = spec.settings_for(TrainingSettings(batch_size=2, seq_len=16, device=target))
    built: list[object] = []
    memplan_s = FreshOutputs.built

    def counted(fresh: FreshOutputs, *args: object) -> object:
        made = memplan_s(fresh, *args)
        if made is not None:
            built.append(made)
        return made

    crosschecked: list[object] = []
    torch_s_crosscheck = FakeTensorMode._crosscheck_cache_output

    def crosscheck(mode: FakeTensorMode, output: object, *args: object) -> None:
        crosschecked.append(output)
        torch_s_crosscheck(mode, output, *args)  # raises where the two differ

    monkeypatch.setattr(FreshOutputs, "built", counted)
    monkeypatch.setattr(FakeTensorMode, "_crosscheck_cache_output", crosscheck)
    with torch._dynamo.config.patch(fake_tensor_cache_crosscheck_enabled=True):  # read as a mode is made
        trace_step(spec, settings)
    checked = {id(tensor) for output in crosschecked for tensor in (output if isinstance(output, tuple) else (output,))}
    # (memplan's builds on a miss too: torch synthesizes an output from the new entry to vet it, unchecked)
    assert len([tensor for tensor in built if id(tensor) in checked]) > 100
