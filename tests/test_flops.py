"""Attention FLOPs with grouped-query shapes, against the matmul arithmetic written out by hand.

flop_counter's SDPA formulas asserted on grouped-query shapes before torch 2.13; memplan broadcasts
key and value heads to the query's so every release counts the same.
"""

import pytest
import torch

from memplan.estimator.flops import node_flops
from memplan.estimator.opgraph import OpNode

aten = torch.ops.aten
BATCH, QUERY_HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 8, 2, 16, 4


def _node(target, *values):
    inputs = [OpNode("placeholder", f"x{i}") for i in range(len(values))]
    for node, value in zip(inputs, values, strict=True):
        node.meta["val"] = value
    node = OpNode("call_function", target, tuple(inputs), inputs=inputs)
    node.meta["val"] = None
    return node


def _qkv():
    query = torch.empty(BATCH, QUERY_HEADS, SEQ, HEAD_DIM, device="meta")
    key = torch.empty(BATCH, KV_HEADS, SEQ, HEAD_DIM, device="meta")
    return query, key, key.clone()


# One multiply-add is two FLOPs; every product runs once per query head (kv heads are shared).
def _matmul(m: int, k: int, n: int) -> int:
    return 2 * BATCH * QUERY_HEADS * m * k * n


FORWARD = _matmul(SEQ, HEAD_DIM, SEQ) + _matmul(SEQ, SEQ, HEAD_DIM)  # scores, then scores @ v
BACKWARD = FORWARD + 3 * _matmul(SEQ, SEQ, HEAD_DIM)  # recomputed scores, dP, dV, dQ, dK


@pytest.mark.parametrize(
    "kernel",
    [
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    ],
)
def test_grouped_query_forward(kernel):
    assert node_flops(_node(kernel, *_qkv())) == FORWARD


@pytest.mark.parametrize(
    "kernel",
    [
        aten._scaled_dot_product_flash_attention_backward.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
    ],
)
def test_grouped_query_backward(kernel):
    query, key, value = _qkv()
    assert node_flops(_node(kernel, torch.empty_like(query), query, key, value)) == BACKWARD


def test_equal_heads_unchanged():
    query = torch.empty(BATCH, QUERY_HEADS, SEQ, HEAD_DIM, device="meta")
    assert node_flops(_node(aten._scaled_dot_product_flash_attention.default, query, query, query)) == FORWARD
