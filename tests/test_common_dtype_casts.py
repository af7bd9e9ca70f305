"""A CPU pointwise kernel copies each tensor not of the op's common dtype to it while it runs, and an output of another
dtype (in place, out=) to a temporary (memplan.estimator.composite_kernels.common_dtype): `h * (h > 0)` copied the
bool mask to float32 in the forward and again in MulBackward0's `grad * mask`, 64 KiB the predicted peak missed
(168,964 B predicted, 234,496 B measured: Linear(16, 256), batch 64, SGD). Truth: the CPU allocator's events of the
op, or of the step, run plainly (no dispatch mode)."""

import pytest
import torch
from torch import nn

from memplan.estimator.composite_kernels import kernel_scratch_bytes
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.estimator.wrapped_numbers import WrappedNumbers
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import held_beside_outputs, profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

aten = torch.ops.aten
_F = torch.randn(4, 8) + 2
_H, _B, _I = _F.half(), _F > 2, torch.arange(1, 33).view(4, 8)

CALLS = {
    "float * bool": (aten.mul.Tensor, (_F, _B)),
    "bool * float": (aten.mul.Tensor, (_B, _F)),
    "float * bool row": (aten.mul.Tensor, (_F, _B[0])),
    "float * expanded bool": (aten.mul.Tensor, (_F, _B[0].expand(4, 8))),
    "float + int": (aten.add.Tensor, (_F, _I)),
    "half * float": (aten.mul.Tensor, (_H, _F)),
    "float * 0-dim float64": (aten.mul.Tensor, (_F, torch.tensor(2.0, dtype=torch.float64))),
    "int * 0-dim float64": (aten.mul.Tensor, (_I, torch.tensor(2.0, dtype=torch.float64))),
    "int / int": (aten.div.Tensor, (_I, _I)),
    "sqrt(int)": (aten.sqrt.default, (_I,)),
    "float > bool": (aten.gt.Tensor, (_F, _B)),
    "float > 0": (aten.gt.Scalar, (_F, 0)),
    "int > 0.5": (aten.gt.Scalar, (_I, 0.5)),
    "where(mask, float, half)": (aten.where.self, (_B, _F, _H)),
    "addcmul(float, half, float)": (aten.addcmul.default, (_F, _H, _F)),
    "half.add_(float)": (aten.add_.Tensor, (_H, _F)),
    "float.mul_(int)": (aten.mul_.Tensor, (_F, _I)),
    "half.mul_(bool)": (aten.mul_.Tensor, (_H, _B)),
    "float * float": (aten.mul.Tensor, (_F, _F)),
}


def _held_beside_outputs(op, args) -> int:  # type: ignore[no-untyped-def]
    """What the allocator held while `op` ran beyond what it returned (on fresh copies of its tensors, made before,
    so that an in-place op writes into its own)."""
    fresh = [arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args]
    return held_beside_outputs(lambda: op(*fresh))


def _numbers_held(op, args) -> int:  # type: ignore[no-untyped-def]
    """What memplan.estimator.wrapped_numbers makes for the call: the numbers a Scalar overload's kernel wraps itself
    (`gt.Scalar`'s 0), and their casts."""
    made: list[int] = []
    numbers = WrappedNumbers(lambda key, nbytes: made.append(nbytes), lambda key: None)
    numbers.after_op(numbers.before_op(op, args, {}), None)
    numbers.close()
    return sum(made)


@pytest.mark.parametrize("name", list(CALLS))
def test_a_pointwise_kernel_s_copies_to_its_common_dtype(name):
    """The copies (composite_kernels.common_dtype) and any number the kernel wraps (wrapped_numbers), together what
    the allocator held beside the op's output."""
    op, args = CALLS[name]
    assert kernel_scratch_bytes(op, args, {}, "cpu") + _numbers_held(op, args) == _held_beside_outputs(op, args)


def test_no_copies_on_cuda():
    assert kernel_scratch_bytes(aten.mul.Tensor, (_F, _B), {}, "cuda") == 0


class _Masked(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.kind = nn.Linear(16, 256), kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "bool-mask":  # copied in the forward, and in MulBackward0's grad * mask
            return (h * (h > 0)).sum()
        if self.kind == "int-mask":  # mean pooling's hidden * attention_mask (int64)
            return (h * (x[:, :1] > 0).long()).sum()
        if self.kind == "half":
            return (h * h.half()).sum()
        if self.kind == "scaled-mask":  # a number wrapped by the parser, cast inside the kernel that copies the mask
            return (h * ((h > 0) * 0.5)).sum()
        return torch.where(h > 0, h, h.half()).sum()


@pytest.mark.parametrize("kind", ["bool-mask", "int-mask", "half", "scaled-mask", "where"])
def test_a_step_with_mixed_dtypes(kind):
    def build():  # type: ignore[no-untyped-def]
        model = _Masked(kind)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(64, 16)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec(f"masked-{kind}", lambda: _Masked(kind), (16,))
    settings = TrainingSettings(batch_size=64, device="cpu", optimizer="sgd")
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured  # validate's counter, a dispatch mode, too
