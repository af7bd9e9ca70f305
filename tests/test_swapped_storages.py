"""memplan.estimator.swapped_storages: which storages parameters' `.data` left and entered, and which a
fake tensor still holds, on tensors built here."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.swapped_storages import parameter_data_swaps, storages_held_by_fake_tensors


def test_a_parameter_pointed_elsewhere_is_noted_with_the_op_count_then():
    param = torch.nn.Parameter(torch.zeros(4))
    first = param.untyped_storage()._cdata
    gathered = torch.ones(8)
    count = iter([3, 7])
    with parameter_data_swaps(lambda: next(count)) as swaps:
        param.data = gathered[:4]  # onto a storage of 32 bytes
        param.data = torch.empty(0)  # released, as ZeRO-3's free_param does
    assert swaps.left_at == {first: 3, gathered.untyped_storage()._cdata: 7}
    assert list(swaps.entered) == [gathered.untyped_storage()._cdata]  # the empty placeholder is not noted
    assert "data" not in torch.nn.Parameter.__dict__  # the property is gone afterwards
    param.data = torch.ones(2)
    assert param.tolist() == [1.0, 1.0]


def test_a_fake_parameter_is_watched_and_a_plain_tensor_is_not():
    with FakeTensorMode():
        param = torch.nn.Parameter(torch.zeros(4))  # a FakeTensor marked as a parameter
        plain = torch.zeros(4)
        replacement = torch.zeros(6)
        with parameter_data_swaps(lambda: 1) as swaps:
            plain.data = torch.zeros(5)
            param.data = replacement
    assert type(param) is not torch.nn.Parameter and isinstance(param, torch.nn.Parameter)
    assert list(swaps.entered) == [replacement.untyped_storage()._cdata] and len(swaps.left_at) == 1


def test_only_storages_a_fake_tensor_still_refers_to_are_held():
    with FakeTensorMode():
        kept = torch.zeros(16)
        view_only = torch.zeros(16)[2:4]  # its base's storage, through the view
        dropped = torch.zeros(16)
        dropped_storage = dropped.untyped_storage()._cdata
        del dropped
    held = storages_held_by_fake_tensors()
    assert kept.untyped_storage()._cdata in held and view_only.untyped_storage()._cdata in held
    assert dropped_storage not in held


def test_lifetimes_settle_as_the_run_held_the_storages():
    """A storage the iteration started with that a parameter left and nothing holds at its end lives to
    its last reader or until the parameter left it, whichever is later; one a parameter entered that is
    still held lives to the end; the rest keep what the graph says (a static storage no parameter left:
    to the end, since nothing says when it went)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from memplan.estimator.swapped_storages import ParameterSwaps, SwappedStorages, settle_lifetimes

    tensors = [torch.zeros(4) for _ in range(7)]
    released_late, released_early, kept_static, regathered, temporary, read_only, never_read = (
        StorageWeakRef(tensor.untyped_storage()) for tensor in tensors
    )
    resized = "a storage FSDP2 resized"  # keys of other kinds are left as they are
    swaps = ParameterSwaps(
        left_at={released_late.cdata: 31, released_early.cdata: 5},
        entered={regathered.cdata: regathered, temporary.cdata: temporary},
    )
    held = frozenset({kept_static.cdata, regathered.cdata})
    # read_only: no parameter left it; never_read: a storage the graph never reads (noted by a wrapper)
    static = {released_late, released_early, kept_static, read_only, never_read}
    read_until = {released_late: 12, released_early: 20, kept_static: 3, regathered: 41, temporary: 42, read_only: 7}
    last_use = {resized: 9, released_late: 50, released_early: 50, kept_static: 50, regathered: 41, temporary: 42}
    last_use |= {read_only: 50, never_read: 50}
    settle_lifetimes(SwappedStorages(swaps, held), static, read_until, last_use, 50)
    assert last_use == {
        resized: 9,
        released_late: 30,
        released_early: 20,
        kept_static: 50,
        regathered: 50,
        temporary: 42,
        read_only: 50,
        never_read: 50,
    }


def test_a_storage_the_library_says_it_drops_lives_to_its_last_reader():
    """DeepSpeed's word that it drops a storage the iteration started with (ZeRO-2's accumulated
    gradients) is evidence like a parameter leaving it: with nothing holding it at the end, it lives
    through its last reader; still held, or never said, to the end."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from memplan.estimator.swapped_storages import ParameterSwaps, SwappedStorages, settle_lifetimes

    tensors = [torch.zeros(4) for _ in range(4)]
    dropped, dropped_but_held, dropped_after_a_parameter_left, unsaid = (
        StorageWeakRef(tensor.untyped_storage()) for tensor in tensors
    )
    swaps = ParameterSwaps(left_at={dropped_after_a_parameter_left.cdata: 33})
    said = frozenset({dropped.cdata, dropped_but_held.cdata, dropped_after_a_parameter_left.cdata})
    static = {dropped, dropped_but_held, dropped_after_a_parameter_left, unsaid}
    read_until = {dropped: 17, dropped_but_held: 17, dropped_after_a_parameter_left: 17, unsaid: 17}
    last_use = {key: 50 for key in static}
    held = frozenset({dropped_but_held.cdata})
    settle_lifetimes(SwappedStorages(swaps, held, said), static, read_until, last_use, 50)
    assert last_use == {dropped: 17, dropped_but_held: 50, dropped_after_a_parameter_left: 32, unsaid: 50}
