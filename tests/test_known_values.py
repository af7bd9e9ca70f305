"""Values a traced step keeps (memplan.estimator.known_values, memplan.estimator.fake_mode)."""

from __future__ import annotations

import torch

from memplan.estimator.fake_mode import TracingFakeMode
from memplan.estimator.known_values import keep_values, tensors_of_values
from tests.test_held_tensors import _OpCounter


def test_a_kept_tensor_is_listed_from_its_values_without_an_op_per_element():
    """torch's FakeTensor.tolist reads each element with `.item()` (an unbind and one op an element): Qwen2-VL's
    get_rope_index lists each row's token types, and its graph grew with the tokens (35,060 nodes at 8,192 tokens,
    26 s to simulate). Truth: the values the tensor was made of, listed without dispatching an op."""
    values = [[index % 3 for index in range(1000)], [1] * 1000]
    with TracingFakeMode(allow_non_fake_inputs=True), tensors_of_values():
        keep_values()
        tokens = torch.tensor(values, dtype=torch.int)
        with _OpCounter() as ops:
            listed = tokens.tolist()
    assert listed == values
    assert ops.count == 0


def test_a_one_element_fill_keeps_its_value_until_an_op_writes_it():
    """The value of a one-element torch.full is answered (ModernBERT's <cls> index); written in place with values the
    trace does not have, it is dropped as torch drops its own constants, not answered stale (a reviewer's find: the
    constant was not registered with the converter, and `add_` left 0 where the real tensor held 1 to 4)."""
    with TracingFakeMode(allow_non_fake_inputs=True):
        index = torch.full((), 3, dtype=torch.long)
        assert int(index) == 3
        count = torch.full((), 0, dtype=torch.long)
        count.add_(torch.randint(1, 5, ()))
        assert count.constant is None
