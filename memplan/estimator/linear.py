"""F.linear adds its bias in place, as a plain run does, where it runs at::matmul.

`at::linear` (aten/src/ATen/native/Linear.cpp, torch 2.11-2.14) runs `addmm` for a 2-D input and
`_flatten_nd_linear` for a contiguous one with a 1-D bias; any other input with a bias (a non-contiguous one: a
slice `hidden[:, 1:]`, a transpose) takes `at::matmul(input, weight.t())` and then `output.add_(*bias)`, unless
`isTensorSubclassLike(*bias)` ("for composite compliance use out-of-place version of `add`"), which a fake tensor
is: memplan's trace ran `at::add(output, *bias)`, holding two outputs where a plain run holds one. A head of 2,048
outputs on a sliced input was predicted 45% high (tests/test_math_attention.py). `linear_tracked` runs the plain
path's `add_` on the product the call has just made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F

from memplan.estimator.composites import CompositeWatcher, added_in_place, plain_path_patched


@contextlib.contextmanager
def linear_tracked(watcher: CompositeWatcher) -> Iterator[None]:
    """While a step is traced (or a real one counted), F.linear (what nn.Linear calls) adds its bias as a plain run
    adds it."""
    with plain_path_patched(watcher, F, "linear", added_in_place):
        yield
