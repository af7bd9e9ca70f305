"""memplan.estimator.oprules.col2im: F.fold's output in the storage of its columns where that is larger.

Truth: the CPU kernel itself on real tensors (cuda/Col2Im.cu makes its output the same way: the module's docstring)."""

from __future__ import annotations

import pytest
import torch

from memplan.estimator.oprules import OUTPUT_BYTES_RULES


@pytest.mark.parametrize(
    ("columns", "output_size", "kernel", "stride"),
    [
        ((2, 27, 196), (16, 16), 3, 1),
        ((4, 48, 64), (32, 32), 4, 4),
        ((27, 256), (18, 18), 3, 1),
        ((1, 3, 4), (4, 4), 1, 2),
    ],
)
def test_col2im_keeps_the_storage_of_its_columns_where_that_is_larger(columns, output_size, kernel, stride):
    """F.fold's op: its output sits in the storage empty_like(columns) made, resized (Col2Im.cpp)."""
    op = torch.ops.aten.col2im.default
    arguments = (torch.randn(columns), list(output_size), [kernel, kernel], [1, 1], [0, 0], [stride, stride])
    real = op(*arguments)
    assert OUTPUT_BYTES_RULES[op](arguments, {}, "cpu") == [real.untyped_storage().nbytes()]
