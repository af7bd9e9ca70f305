"""memplan.estimator.oprules.dtypes: mixed dtypes the real matmul kernels refuse and the fake kernels let through."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from memplan.cli import main
from memplan.estimator.oprules.dtypes import MATMUL_OPS, refused_mixed_dtypes

_CALLS = {
    "mm": lambda x, w: torch.ops.aten.mm.default(x, w),
    "addmm": lambda x, w: torch.ops.aten.addmm.default(w[0], x, w),
    "bmm": lambda x, w: torch.ops.aten.bmm.default(x[None], w[None]),
    "baddbmm": lambda x, w: torch.ops.aten.baddbmm.default(x[None], x[None], w[None]),
    "addbmm": lambda x, w: torch.ops.aten.addbmm.default(x, x[None], w[None]),
    "mv": lambda x, w: torch.ops.aten.mv.default(x, w[0]),
    "addmv": lambda x, w: torch.ops.aten.addmv.default(x[:, 0], x, w[0]),
    "dot": lambda x, w: torch.ops.aten.dot.default(x[0], w[0]),
}


def test_every_op_of_the_rule_is_one_the_real_cpu_kernel_refuses_with_mixed_dtypes():
    """The premise, on the installed torch: each real kernel raises, and the rule says so for the same arguments."""
    assert {op.name().removeprefix("aten::") for op in MATMUL_OPS} == set(_CALLS)
    x, w = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.bfloat16)
    for name, call in _CALLS.items():
        with pytest.raises(RuntimeError):
            call(x, w)
        with pytest.raises(RuntimeError, match="needs operands of one dtype"):
            call_through_rule(name, call, x, w)
        call(x, w.float())  # one dtype: runs


def call_through_rule(name: str, call, x: torch.Tensor, w: torch.Tensor) -> None:
    """The rule's answer for the arguments the call passes (recorded by a dispatch mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Asked(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            refused = refused_mixed_dtypes(func, args)
            if refused is not None:
                raise RuntimeError(refused)
            return func(*args, **(kwargs or {}))

    with Asked():
        call(x, w)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def float_rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16)


def test_a_float32_batch_into_bfloat16_weights_is_refused_as_the_real_step_is():
    """It had been estimated (the fake addmm takes float32 and bfloat16), where the real step raises (two bug hunts)."""
    args = ["estimate", "tests.test_oprules_dtypes:mlp", "--inputs", "tests.test_oprules_dtypes:float_rows",
            "--device", "cpu", "-b", "4"]  # fmt: skip
    refused = CliRunner().invoke(main, [*args, "--precision", "bf16"])
    assert refused.exit_code == 1 and "needs operands of one dtype" in refused.output
    assert "float_rows (tensor (4, 16) float32)" in refused.output
    with pytest.raises(RuntimeError):  # the real step
        nn.Sequential(*mlp()).to(torch.bfloat16)(float_rows(4))
    autocast = CliRunner().invoke(
        main, [*args, "--precision", "amp-bf16", "--loss", "tests.zoo_models:mean_square_loss"]
    )
    assert autocast.exit_code == 0, autocast.output  # autocast casts before the kernel: nothing mixed


_INDEXING = {
    "index_add": lambda s, i, v: torch.index_add(s, 0, i, v),
    "index_copy": lambda s, i, v: torch.index_copy(s, 0, i, v),
    "index_put": lambda s, i, v: s.index_put((i,), v),
    "index_put_": lambda s, i, v: s.clone().index_put_((i,), v),
}


@pytest.mark.parametrize("name", _INDEXING)
def test_indexing_ops_the_real_cpu_kernel_refuses_with_mixed_dtypes_are_refused(name):
    """index_add under CPU autocast (a float32 buffer, bfloat16 values) ran in the trace, the fake kernel taking
    the destination's dtype, where the real step raises (a helper's bug hunt)."""
    destination, index = torch.zeros(4, 3), torch.tensor([0, 2])
    values = torch.ones(2, 3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        _INDEXING[name](destination, index, values)
    with pytest.raises(RuntimeError, match="dtype|scalar type"):
        call_through_rule(name, lambda x, w: _INDEXING[name](x, index, w), destination, values)
    _INDEXING[name](destination, index, values.float())  # one dtype: runs
    call_through_rule(name, lambda x, w: _INDEXING[name](x, index, w), destination, values.float())


def test_one_value_put_through_a_mask_is_cast_as_the_real_kernel_casts_it():
    """`x[mask] = value` with a one-element value of another dtype runs (index_put_ takes masked_fill_'s path,
    canDispatchToMaskedFill): not refused."""
    destination, mask = torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool)
    value = torch.tensor(1.0, dtype=torch.bfloat16)
    destination.clone().index_put_((mask,), value)  # the real kernel runs
    call_through_rule("index_put_", lambda x, w: x.clone().index_put_((mask,), w), destination, value)
