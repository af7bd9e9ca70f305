"""memplan.estimator.fake_cache_keys: the cache keys memplan's fake mode writes are torch's own, element for element
(truth: torch's FakeTensorMode._prep_args_for_hash run on the same mode and arguments)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache, _CacheKeyState

from memplan.estimator.fake_mode import TracingFakeMode


def _keys(mode: TracingFakeMode, args: object) -> tuple[list[object], list[object]]:
    """The key elements memplan's mode writes for `args`, and those torch's own function writes: torch's recurses
    through the mode's `_prep_args_for_hash` (into containers, and from TensorMetadata._flatten_into into sizes), so
    for torch's side the mode's own is torch's too (an attribute of the instance, for the call's length)."""
    ours: list[object] = []
    mode._prep_args_for_hash(ours, args, _CacheKeyState(), [])
    torch_s: list[object] = []
    mode._prep_args_for_hash = functools.partial(FakeTensorMode._prep_args_for_hash, mode)  # type: ignore[method-assign]
    try:
        mode._prep_args_for_hash(torch_s, args, _CacheKeyState(), [])
    finally:
        del mode._prep_args_for_hash
    return ours, torch_s


def _same(ours: list[object], torch_s: list[object]) -> None:
    assert len(ours) == len(torch_s)
    for index, (mine, theirs) in enumerate(zip(ours, torch_s, strict=True)):
        assert type(mine) is type(theirs) and mine == theirs, (index, mine, theirs)


def _tensors(mode: TracingFakeMode) -> dict[str, torch.Tensor]:
    with mode:
        base = torch.empty(4, 6, requires_grad=True)
        images = torch.empty(2, 3, 5, 7).to(memory_format=torch.channels_last)
        complex_values = torch.empty(3, 4, dtype=torch.complex64)
        tensors = {
            "contiguous, requires grad": base,
            "channels last": images,
            "channels last 3d": torch.empty(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
            "transposed": base.detach().t(),
            "sliced, with an offset": base.detach()[1:, 2:],
            "expanded": torch.empty(1, 5).expand(3, 5),
            "0-d integer": torch.empty((), dtype=torch.int64),
            "empty": torch.empty(0, 3, dtype=torch.bfloat16),
            "conjugate": complex_values.conj(),
            "negative view": torch._neg_view(complex_values.conj()),
        }
        with torch.inference_mode():
            tensors["inference"] = torch.empty(2, 2)
    return tensors


def test_each_kind_of_fake_tensor_has_torch_s_key():
    mode = TracingFakeMode(allow_non_fake_inputs=True)
    for name, tensor in _tensors(mode).items():
        ours, torch_s = _keys(mode, (tensor,))
        _same(ours, torch_s)
        assert len(ours) > 20, name


def test_arguments_of_every_plain_kind_nested_have_torch_s_key():
    mode = TracingFakeMode(allow_non_fake_inputs=True)
    tensors = list(_tensors(mode).values())
    args = (
        tensors[0],
        [tensors[1], tensors[2]],
        3,
        2.5,
        True,
        None,
        "mean",
        torch.float16,
        torch.device("cpu"),
        torch.strided,
        torch.channels_last,
        torch.Size([2, 3]),
        (1, (2, [3, tensors[3]])),
        [],
        1 + 2j,  # (left to torch's own function, as anything the module does not write itself)
        Ellipsis,
    )
    _same(*_keys(mode, args))
    _same(*_keys(mode, {"dim": 1, "out": tensors[4], "sizes": [tensors[5], 2], "keepdim": False}))


def test_plain_tensors_are_written_without_torch_s_metadata_machinery(monkeypatch):
    """The point of the module: torch's extract_tensor_metadata never runs for a plain fake tensor."""
    mode = TracingFakeMode(allow_non_fake_inputs=True)
    tensors = _tensors(mode)

    def refused(tensor: torch.Tensor) -> None:
        raise AssertionError("torch's extract_tensor_metadata ran")

    monkeypatch.setattr(fake_tensor, "extract_tensor_metadata", refused)
    ours: list[object] = []
    mode._prep_args_for_hash(ours, tuple(tensors.values()), _CacheKeyState(), [])
    assert len(ours) > 20 * len(tensors)


def test_what_torch_bypasses_the_cache_for_is_still_torch_s_to_bypass():
    mode = TracingFakeMode(allow_non_fake_inputs=True)
    other = TracingFakeMode(allow_non_fake_inputs=True)
    with other:
        another_modes = torch.empty(2)
    constant = mode.fake_tensor_converter.from_real_tensor(mode, torch.tensor([1.0, 2.0]), make_constant=True)
    cases = {
        "not our fake": another_modes,
        "non-fake tensor": torch.ones(2),
        "constant attribute": constant,
        "function argument": lambda: None,
    }
    assert constant.constant is not None
    for reason, argument in cases.items():
        with pytest.raises(_BypassDispatchCache, match=reason):
            mode._prep_args_for_hash([], (1, [argument]), _CacheKeyState(), [])
        with pytest.raises(_BypassDispatchCache, match=reason):
            FakeTensorMode._prep_args_for_hash(mode, [], (1, [argument]), _CacheKeyState(), [])


def test_a_traced_op_is_answered_from_the_cache_entry_torch_s_own_key_made():
    """The keys are shared: an op torch's own FakeTensorMode cached is a hit for memplan's mode."""
    FakeTensorMode.cache_clear()
    torch_mode = FakeTensorMode()
    with torch_mode:
        torch.empty(3, 5).mul(torch.empty(3, 5))
    mode = TracingFakeMode()
    hits, misses = FakeTensorMode.cache_hits, FakeTensorMode.cache_misses
    with mode:
        torch.empty(3, 5).mul(torch.empty(3, 5))
    assert (FakeTensorMode.cache_hits, FakeTensorMode.cache_misses) == (hits + 3, misses)  # both empty()s, the mul


def test_a_view_of_concrete_sizes_on_a_storage_of_symbolic_size_is_left_to_torch():
    """A row of an (s0, 3) tensor has concrete sizes, strides and offset, and a storage of 12*s0 bytes, which torch
    writes as a symbol's stub (convert_sym_int), recording the shape environment the entry is then cached in (a
    review's find: written raw, the key could not be hashed and the op failed)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = TracingFakeMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    rows = mode.from_tensor(torch.randn(5, 3), symbolic_context=context, source=ConstantSource("rows"))
    with mode:
        row = rows[0]
    assert not row._has_symbolic_sizes_strides and type(row.untyped_storage().nbytes()) is not int
    ours, torch_s = _keys(mode, (row, 2))
    assert [type(item).__name__ for item in ours] == [type(item).__name__ for item in torch_s]
    assert "_PySymInputStub" in {type(item).__name__ for item in ours}
    with mode:
        assert row.mul(2).shape == (3,)  # hashed, cached and answered
        assert row.mul(2).shape == (3,)
