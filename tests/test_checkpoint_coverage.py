"""What memplan's checkpointing really does to a real model, read off autograd rather than a peak.

The truths are observations of the real step, not memplan's accounting:
- which blocks save tensors for backward: a `saved_tensors_hooks` around the forward sees every
  tensor autograd saves outside a non-reentrant checkpoint (inside one, the checkpoint's own hooks
  take the tensors instead), attributed to the block whose forward is running. A checkpointed
  block saves exactly its positional tensor inputs (torch.utils.checkpoint's `_NoopSaveInputs`);
- what a policy recomputes: a dispatch mode around `backward()` counts the forward ops replayed there.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.checkpoint_layout import CheckpointLayout
from memplan.estimator.checkpointing import block_names
from memplan.estimator.loop import call_model, prepare
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

aten = torch.ops.aten


def _prepared(tiny_model_dirs, model: str, checkpoint: str | CheckpointLayout):  # type: ignore[no-untyped-def]
    spec = resolve_model(str(tiny_model_dirs[model]))
    settings = spec.settings_for(TrainingSettings(batch_size=2, seq_len=32, device="cpu", checkpoint=checkpoint))
    torch.manual_seed(0)
    return spec, settings, prepare(spec, settings)


def _saved_per_block(tiny_model_dirs, model: str, checkpoint: str | CheckpointLayout) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Tensors autograd saves outside any checkpoint during one forward, by the block running then,
    and under "inputs <block>" the positional tensors each block was called with."""
    spec, settings, state = _prepared(tiny_model_dirs, model, checkpoint)
    blocks = block_names(state.model)
    running: list[str] = []
    handles = []
    for name in blocks:
        module = state.model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda _m, args, name=name: enter(name, args)))
        handles.append(module.register_forward_hook(lambda _m, _a, _o: running.pop() and None))  # None: keep output
    saved: collections.Counter[str] = collections.Counter({name: 0 for name in blocks})

    def enter(name: str, args: tuple) -> None:
        running.append(name)
        saved[f"inputs {name}"] = sum(isinstance(arg, torch.Tensor) for arg in args)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[running[-1] if running else "outside blocks"] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        spec.loss_of(call_model(state.model, state.batch), state.batch)
    for handle in handles:
        handle.remove()
    return dict(saved)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_checkpoint_all_leaves_no_block_saving_tensors(model, tiny_model_dirs):
    plain = _saved_per_block(tiny_model_dirs, model, "none")
    blocks = [name for name in plain if name != "outside blocks" and not name.startswith("inputs ")]
    assert len(blocks) >= 2 and all(plain[name] > 10 for name in blocks)  # every block saves much without it
    checkpointed = _saved_per_block(tiny_model_dirs, model, "all")
    assert {name: checkpointed[name] for name in blocks} == {name: checkpointed[f"inputs {name}"] for name in blocks}
    assert all(checkpointed[f"inputs {name}"] == 1 for name in blocks)  # the hidden states only
    assert checkpointed["outside blocks"] == plain["outside blocks"]  # embeddings, final norm, head: untouched


def test_a_layout_checkpoints_exactly_its_blocks(tiny_model_dirs):
    plain = _saved_per_block(tiny_model_dirs, "gpt2", "none")
    blocks = [name for name in plain if name != "outside blocks" and not name.startswith("inputs ")]
    layout = CheckpointLayout(segments=((blocks[0],),))
    saved = _saved_per_block(tiny_model_dirs, "gpt2", layout)
    assert saved[blocks[0]] == 1  # its input
    assert {name: saved[name] for name in blocks[1:]} == {name: plain[name] for name in blocks[1:]}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(tiny_model_dirs, checkpoint: str) -> collections.Counter:  # type: ignore[no-untyped-def]
    spec, settings, state = _prepared(tiny_model_dirs, "llama", checkpoint)
    loss = spec.loss_of(call_model(state.model, state.batch), state.batch)
    with _CountOps() as mode:
        loss.backward()
    return mode.counts


def test_the_selective_policy_recomputes_pointwise_ops_but_not_matmuls(tiny_model_dirs):
    """torch's own backward of mm is mm, so matmuls in backward without checkpointing are the floor;
    a policy that kept nothing would replay every forward matmul as full checkpointing does."""
    plain = _backward_ops(tiny_model_dirs, "none")
    full = _backward_ops(tiny_model_dirs, "all")
    selective = _backward_ops(tiny_model_dirs, "selective")
    matmuls = (aten.mm.default, aten.bmm.default, aten.addmm.default)
    count = lambda counts: sum(counts[op] for op in matmuls)  # noqa: E731
    assert count(full) > count(plain)  # full recomputation replays the forward's matmuls
    assert count(selective) == count(plain)  # selective keeps every matmul output
    # ...and replays the cheap ops: llama's SiLU and RMSNorm's rsqrt run in backward only when recomputed.
    for op in (aten.silu.default, aten.rsqrt.default):
        assert plain[op] == 0 and selective[op] == full[op] > 0


def test_a_segment_keeps_only_its_first_blocks_inputs(tiny_model_dirs):
    plain = _saved_per_block(tiny_model_dirs, "llama", "none")
    blocks = [name for name in plain if name != "outside blocks" and not name.startswith("inputs ")]
    saved = _saved_per_block(tiny_model_dirs, "llama", CheckpointLayout(segments=(tuple(blocks),)))
    # The segment's hooks run before this test's (registered first), so the one input it keeps, the
    # hidden state entering the first block, is counted outside the blocks.
    assert [saved[name] for name in blocks] == [0] * len(blocks)
    assert saved["outside blocks"] == plain["outside blocks"] + 1


def test_a_segment_of_blocks_honours_its_policy(tiny_model_dirs):
    """A two-block segment with the selective policy replays no matmul (as many in backward as
    without checkpointing), the same segment with the full policy replays them all."""
    names = ("model.layers.0", "model.layers.1")
    matmuls = (aten.mm.default, aten.bmm.default, aten.addmm.default)
    count = lambda counts: sum(counts[op] for op in matmuls)  # noqa: E731
    plain = count(_backward_ops(tiny_model_dirs, "none"))
    selective = count(_backward_ops(tiny_model_dirs, CheckpointLayout(segments=(names,), policies=("selective",))))
    full = count(_backward_ops(tiny_model_dirs, CheckpointLayout(segments=(names,), policies=("full",))))
    assert selective == plain < full
