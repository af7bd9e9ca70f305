"""One rank's peak of a two-layer MLP under each data-parallel strategy, counted by hand.

Truth: the bytes each tensor of the step takes, worked out here from the model's dimensions and
from what torch's DDP, ZeroRedundancyOptimizer and FSDP2 (torch/distributed/fsdp/_fully_shard) are
documented and written to allocate; nothing of memplan's is used on this side. The model is
tests/two_layer_mlp.py: x [B, 64] -> Linear(64, 256, no bias) -> ReLU -> Linear(256, 30, no bias),
float32, loss = out.square().mean(), on the cpu target (bytes as stored, no allocator rounding).

Each strategy's peak is the largest of a few moments of the step, each a sum of named tensors:
- the forward's ReLU: the input x, the first layer's output h and ReLU's output a;
- the backward's ReLU: a (saved), its incoming gradient and its result (both [B, 256]) and the
  second layer's weight gradient, made just before it;
- the optimizer step (AdamW on the cpu, torch's single-tensor implementation): `denom =
  (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds two temporaries the size of the
  parameter it updates, the larger one's at the peak, and, while the quotient is made, the Python float
  it divides by as torch's argument parser wraps it (a float64 scalar tensor) and the division kernel's
  float32 copy of it (TensorIterator casts a CPU scalar to the common dtype); each parameter's state is
  two moments and a float32 `step` scalar.
The canonical loop binds the loss (`loss = loss_fn(model(x))`) until the iteration ends: the loss scalar counts in
the backward and in the step; the loss's gradient (the root gradient) in the backward only.
"""

from __future__ import annotations

import pytest

import memplan
from tests.two_layer_mlp import HIDDEN, IN, OUT

F32 = 4
W1 = HIDDEN * IN * F32  # the first layer's weight, [256, 64]
W2 = OUT * HIDDEN * F32  # the second's, [30, 256]
PARAMETERS = W1 + W2
ADAMW_STEP = F32  # state["step"]: a float32 scalar per parameter (capturable=False)
DIVISOR = 8 + F32  # `/ bias_correction2_sqrt`: the wrapped float64 number and the kernel's float32 cast of it
LOSS = F32
# torch.autograd.backward's root gradient, ones_like(loss), which its local `grad_tensors_` holds until the engine
# returns (torch/autograd/__init__.py): it counts through the whole backward.
ROOT_GRADIENT = F32
SOURCE = {"inputs": "tests.two_layer_mlp:rows", "loss": "tests.two_layer_mlp:mean_square"}


def _predicted(parallel: str, world_size: int, optimizer: str, batch_size: int) -> int:
    result = memplan.estimate(
        "tests.two_layer_mlp:two_layer",
        **SOURCE,
        batch_size=batch_size,
        device="cpu",
        optimizer=optimizer,
        parallel=parallel,
        world_size=world_size,
    )
    return result.peak_bytes


def _activation(batch_size: int) -> int:
    return batch_size * HIDDEN * F32  # h, a, and their gradients: [B, 256]


def _input(batch_size: int) -> int:
    return batch_size * IN * F32


def _adamw_step(parameters: int, gradients: int, owned: list[int]) -> int:
    """The single-tensor step's peak: parameters, gradients, for each parameter the optimizer owns
    two moments and a step scalar, and the largest one's two temporaries (sqrt, then the quotient) beside
    the divisor's two scalars."""
    state = sum(2 * size + ADAMW_STEP for size in owned)
    return parameters + gradients + state + 2 * max(owned) + DIVISOR


def _rows_per_rank(rows: int, world_size: int) -> int:
    """torch.chunk's chunk size along dim 0, which FSDP2 pads every rank's shard to."""
    return -(-rows // world_size)


def _shard(world_size: int) -> int:
    """Rank 0's shards of both weights (FSDP2 shards dim 0, padded)."""
    return (_rows_per_rank(HIDDEN, world_size) * IN + _rows_per_rank(OUT, world_size) * HIDDEN) * F32


def _gathered(world_size: int) -> int:
    """One all-gather's output, world_size padded shards; each unsharded parameter is a view of a
    per-parameter output of its padded size (FSDPParam.init_all_gather_outputs), so the unsharded
    parameters take the same."""
    return world_size * _shard(world_size)


# SGD without momentum at batch 512: no optimizer state, the peak in the backward.


def test_one_process_sgd_peaks_at_relus_backward():
    batch = 512
    backward = PARAMETERS + _input(batch) + LOSS + ROOT_GRADIENT + W2 + 3 * _activation(batch)
    forward = PARAMETERS + _input(batch) + 2 * _activation(batch)
    assert _predicted("none", 1, "sgd", batch) == max(backward, forward) == backward


def test_a_ddp_rank_adds_one_bucket_of_gradient_copies():
    """DDP's Reducer allocates its buckets when it is built and keeps them: the first bucket is
    capped at 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), and both gradients (94 KiB) fit in it;
    with gradient_as_bucket_view=False (the default) it is a copy of every gradient."""
    batch = 512
    buckets = PARAMETERS
    backward = PARAMETERS + buckets + _input(batch) + LOSS + ROOT_GRADIENT + W2 + 3 * _activation(batch)
    assert _predicted("ddp", 4, "sgd", batch) == backward


@pytest.mark.parametrize("parallel", ["fsdp", "fsdp-grad-op"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_an_fsdp2_rank_of_sgd_holds_the_shards_and_the_gathered_root(parallel, world_size):
    """fully_shard on the root alone (the MLP has no repeated blocks). In the backward the root's
    parameters are gathered (the root is never resharded after its forward: FSDPState._lazy_init
    sets its post_forward_mesh_info to None, so both modes agree); the all-gather's buffer was freed
    at the root's post-forward; the reduce-scatter comes after the whole backward. The weight
    gradient is autograd's, unpadded."""
    batch = 512
    backward = (
        _shard(world_size) + _gathered(world_size) + _input(batch) + LOSS + ROOT_GRADIENT + W2 + 3 * _activation(batch)
    )
    assert _predicted(parallel, world_size, "sgd", batch) == backward


# AdamW at batch 4: the state counts, the activations hardly.


def test_one_process_adamw_peaks_in_the_step():
    batch = 4
    step = _input(batch) + LOSS + _adamw_step(PARAMETERS, PARAMETERS, [W1, W2])
    forward = PARAMETERS + 2 * PARAMETERS + 2 * ADAMW_STEP + _input(batch) + 2 * _activation(batch)
    assert _predicted("none", 1, "adamw", batch) == max(step, forward) == step


def test_a_ddp_rank_of_adamw_adds_the_bucket_to_the_step():
    batch = 4
    step = PARAMETERS + _input(batch) + LOSS + _adamw_step(PARAMETERS, PARAMETERS, [W1, W2])
    assert _predicted("ddp", 2, "adamw", batch) == step


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_a_zero1_rank_keeps_the_state_of_its_share(world_size):
    """ZeroRedundancyOptimizer hands out whole parameters, largest first, each to the rank with the
    fewest elements so far: rank 0 takes the first weight (16,384 elements) at every world size and
    keeps its moments and step scalar alone; parameters, gradients and DDP's bucket stay whole."""
    batch = 4
    buckets = PARAMETERS
    step = buckets + _input(batch) + LOSS + _adamw_step(PARAMETERS, PARAMETERS, [W1])
    assert _predicted("zero1", world_size, "adamw", batch) == step


@pytest.mark.parametrize("parallel", ["fsdp", "fsdp-grad-op"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_an_fsdp2_rank_of_adamw_peaks_in_the_forward_or_at_the_reduce_scatter(parallel, world_size):
    """In the forward the root's all-gather buffer (kept in AllGatherState until the root's
    post-forward) and the unsharded parameters copied out of it live beside the shards and their
    state. The reduce-scatter, after the backward, comes after the root reshards (post_backward
    frees the unsharded parameters first); on the CPU its copy-in (`_chunk_cat`) first copies each
    gradient whose rows the world does not divide into a padded tensor (TensorShape.cpp `_pad_chunk`):
    the second weight's 30 rows on 4 and 8 ranks, where that is the peak. The step runs on shards."""
    batch = 4
    shard, gathered = _shard(world_size), _gathered(world_size)
    shard_w1 = _rows_per_rank(HIDDEN, world_size) * IN * F32
    state = 2 * shard + 2 * ADAMW_STEP
    forward = shard + state + gathered + gathered + _input(batch) + 2 * _activation(batch)
    # post_backward: the unpadded unsharded gradients, then the reduce-scatter's input (padded), and while it is
    # made, the padded copies
    padded_w2 = world_size * _rows_per_rank(OUT, world_size) * HIDDEN * F32 if OUT % world_size else 0
    reduce_scatter = shard + state + PARAMETERS + gathered + _input(batch) + LOSS + ROOT_GRADIENT + padded_w2
    # The step's gradients are the reduce-scatter's output, one padded shard.
    step = _input(batch) + LOSS + _adamw_step(shard, shard, [shard_w1, shard - shard_w1])
    expected = forward if world_size == 2 else reduce_scatter  # 30 rows: 2 divides them, 4 and 8 do not
    assert _predicted(parallel, world_size, "adamw", batch) == max(forward, reduce_scatter, step) == expected
