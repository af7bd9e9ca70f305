"""Python numbers an autograd formula saves: `y * 0.5` saves the 0.5 as an 8-byte tensor.

Python's argument parser makes a Python number given for a Tensor argument a 0-dim "wrapped number"
tensor (at::scalar_to_tensor, which allocates on the CPU without dispatching), MulBackward0 saves it
when `y` requires grad, and SavedVariable keeps it without calling saved_tensors_hooks ("avoid wrapped
numbers from being leaked to the user", torch/csrc/autograd/saved_variable.cpp), so a checkpoint's hooks
do not drop it either. A dispatch mode sees the number as a Python scalar, so each such saved number
(8 B; 4 blocks x 3 here: 96 B) was missing from the prediction (memplan.estimator.wrapped_numbers).
Truth: the same step run plainly, measured by the CPU allocator's events (tests/hand_measure.py).
"""

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.estimator.wrapped_numbers import WrappedNumbers
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.hand_measure import (
    checkpoint_each,
    profiled_causal_lm_peak,
    profiled_third_iteration_peak,
    training_iteration,
)
from tests.lora_models import SEQ_LEN, peft_gpt2, tokens
from tests.module_specs import loss_returning_spec
from tests.zoo import TINY_HF_CONFIGS

SCALES_PER_BLOCK = 3
BLOCKS = 4
BATCH = 32


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        for _ in range(SCALES_PER_BLOCK):
            y = y * 0.5  # MulBackward0 saves the wrapped 0.5
        return self.fc2(torch.tanh(y))


class _ScaledStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().sum()


SPEC = loss_returning_spec("scaled-stack", _ScaledStack, (16,))


def _measured(checkpointed: bool) -> int:
    def build():  # type: ignore[no-untyped-def]
        model = _ScaledStack()
        if checkpointed:
            checkpoint_each(model.blocks)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(BATCH, 16)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    return profiled_third_iteration_peak(build)


def test_saved_python_numbers_are_counted():
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    measured = _measured(checkpointed=False)
    assert simulate(trace_step(SPEC, settings)).peak_bytes == measured
    assert measure_cpu(SPEC, settings).peak_bytes == measured  # validate's counter, a dispatch mode, too


def test_saved_python_numbers_outlive_a_checkpoint():
    """A checkpoint's hooks never see a wrapped number: its Node keeps it to the backward, and the recomputation saves
    its own again."""
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd", checkpoint="all")
    measured = _measured(checkpointed=True)
    traced = trace_step(SPEC, settings)
    assert traced.checkpointed_blocks == [f"blocks.{index}" for index in range(BLOCKS)]
    assert simulate(traced).peak_bytes == measured


def features(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16)


def halved_loss_step(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """A user's --step: the model's loss halved (one more number saved, the step's own), then the update."""
    (model(batch) * 0.5).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_saved_python_numbers_are_counted_in_a_custom_step():
    """--step traces through its own recorder (memplan.estimator.custom_step_trace): the numbers are counted there."""
    spec = resolve_model("tests.test_wrapped_scalars:_ScaledStack", inputs="tests.test_wrapped_scalars:features")
    settings = spec.settings_for(
        TrainingSettings(
            batch_size=BATCH, device="cpu", optimizer="sgd", step="tests.test_wrapped_scalars:halved_loss_step"
        )
    )

    def build():  # type: ignore[no-untyped-def]
        model = _ScaledStack()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = features(BATCH)
        build.kept = (model, optimizer, batch)
        return lambda: halved_loss_step(model, batch, optimizer)

    assert simulate(trace_step(spec, settings)).peak_bytes == profiled_third_iteration_peak(build)


def _plain_hf_run(model_of) -> int:  # type: ignore[no-untyped-def]
    """The canonical loop with AdamW, batch 2 of tests.lora_models.tokens (as memplan's batch for a causal LM:
    input_ids and a copy as labels), measured by the allocator's events."""
    return profiled_causal_lm_peak(model_of, lambda: tokens(2))


def test_gpt2s_gelu_numbers_are_counted(tiny_model_dirs):
    """GPT-2's NewGELU, `0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0))))`, has three products
    by a number whose MulBackward0 saves it: 3 x 8 B a layer, 48 B for the zoo's 2 layers (predicted 48 B low)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = resolve_model(tiny_model_dirs["gpt2"])
    settings = spec.settings_for(TrainingSettings(batch_size=2, seq_len=SEQ_LEN, device="cpu"))
    config = AutoConfig.for_model(**TINY_HF_CONFIGS["gpt2"], use_cache=False)
    measured = _plain_hf_run(lambda: AutoModelForCausalLM.from_config(config))
    assert simulate(trace_step(spec, settings)).peak_bytes == measured


def test_loras_scaling_is_counted():
    """peft's LoRA layer returns `result + lora_B(lora_A(dropout(x))) * scaling`: its MulBackward0 saves the scaling,
    8 B per adapted layer beside GPT-2's own 48 B (64 B low on peft's GPT-2: c_attn in 2 layers)."""
    spec = resolve_model("tests.lora_models:peft_gpt2", inputs="tests.lora_models:tokens")
    settings = spec.settings_for(TrainingSettings(batch_size=2, device="cpu"))
    assert simulate(trace_step(spec, settings)).peak_bytes == _plain_hf_run(peft_gpt2)


class _Numbers(TorchDispatchMode):
    """memplan's account of each op's numbers (memplan.estimator.wrapped_numbers.WrappedNumbers) as allocator events:
    + the bytes it makes, + each output's, - what it frees."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[int] = []
        sizes: dict[object, int] = {}

        def made(key: object, nbytes: int) -> None:
            sizes[key] = nbytes
            self.events.append(nbytes)

        self.numbers = WrappedNumbers(made, lambda key: self.events.append(-sizes.pop(key)))

    def __torch_dispatch__(self, func, types, args, kwargs=None):  # type: ignore[no-untyped-def]
        made = self.numbers.before_op(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        self.events.append(out.untyped_storage().nbytes())
        self.numbers.after_op(made, out)
        return out


def _allocator_events(op) -> list[int]:  # type: ignore[no-untyped-def]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        op()
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    return [event.nbytes() for event in sorted(events, key=lambda event: event.start_ns())]


def _counted_events(op) -> list[int]:  # type: ignore[no-untyped-def]
    """The wrapped numbers' events memplan counts for one run of `op` (after a run that warms it up)."""
    op()
    counted = _Numbers()
    with counted:
        out = op()
    counted.numbers.close()
    del out
    return counted.events


def test_a_kernel_casts_its_numbers_to_the_common_dtype():
    """A pointwise CPU kernel casts a wrapped number to its common dtype for as long as it runs (float64 0.5 to one
    float16, 2 B; `a // 2`'s floor_divide, a TensorIterator op with no pointwise tag); a number already of the common
    dtype is not cast. Truth: the allocator's events of the op run plainly (the output freed last, as the op's result
    is dropped)."""
    floats, halves, ints = torch.randn(4), torch.randn(4, dtype=torch.float16), torch.arange(4)
    for op in (
        lambda: floats * 0.5,
        lambda: halves * 0.5,
        lambda: floats // 2,
        lambda: ints + True,
        lambda: ints * 2,
    ):
        assert _allocator_events(op)[:-1] == _counted_events(op)


class _CaughtFailure(nn.Module):
    """A forward that tries an op given a Python number, which raises, and goes on without it (as code probing a
    kernel does): the failed call's wrapped number and cast go with it."""

    def __init__(self, tries: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.tries = nn.Linear(16, 16), tries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tries:
            try:
                torch.zeros(3, dtype=torch.int64).add_(2.5)  # a Float result can't be cast to Long
            except RuntimeError:
                pass
        return self.fc(x).square().sum()


def test_a_failed_op_s_numbers_do_not_outlive_it():
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    peaks = [
        simulate(trace_step(loss_returning_spec(f"caught-{tries}", lambda t=tries: _CaughtFailure(t), (16,)), settings))
        for tries in (False, True)
    ]
    # the int64 zeros (24 B) live a moment in the forward, far from the peak; the number and cast had stayed to the end
    assert peaks[1].peak_bytes == peaks[0].peak_bytes


def test_functions_run_in_an_op_s_place_are_not_cached():
    """A dispatch mode's stand-in for an op (plain_formulas' closures, new at each Node) has no Tensor arguments to
    wrap, and the module's cache of schemas must not keep it (nor what it holds) for the process's life."""
    from memplan.estimator import wrapped_numbers

    def stand_in(a, b):  # type: ignore[no-untyped-def]
        return a

    assert wrapped_numbers.wrapped_numbers_of(stand_in, (torch.ones(2), 1.0), {}) == []
    assert stand_in not in wrapped_numbers._TENSOR_ARGUMENTS


def _peak(events: list[int]) -> int:
    total = peak = 0
    for nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return peak


def test_scalar_overloads_that_wrap_their_number_in_the_kernel():
    """`x > 0`, `1 - x`, `x % 2`, `2 ** x`, and mul.Scalar as C++ autograd formulas call it: a Scalar overload whose
    kernel makes the number a 0-dim tensor itself (`wrapped_scalar_tensor`, then the Tensor overload), 8 B and its cast
    while the op runs; ops that read their Scalar by value (clamp, masked_fill, pow's exponent, an alpha) allocate
    nothing for it. Truth: the allocator's events of the op run plainly; compared by their peak (the order of the
    number, its cast and the output differs between kernels: pow.Scalar makes its output first)."""
    floats, halves, ints = torch.randn(4), torch.randn(4, dtype=torch.float16), torch.arange(4)
    mask = floats > 0
    aten = torch.ops.aten
    for op in (
        lambda: floats > 0,
        lambda: halves <= 0.5,
        lambda: ints == 0,
        lambda: 1 - floats,
        lambda: 1.0 - halves,
        lambda: floats % 2,
        lambda: torch.fmod(floats, 2),
        lambda: 2**floats,
        lambda: torch.xlogy(floats, 2.0),
        lambda: ints & 1,
        lambda: ints << 1,
        lambda: aten.mul.Scalar(floats, 0.5),
        lambda: aten.add.Scalar(floats, 1, 2),
        lambda: aten.div.Scalar(floats, 2),
        lambda: aten.div.Scalar_mode(floats, 2, rounding_mode="floor"),
        lambda: floats.clamp(min=0.1),
        lambda: floats.masked_fill(mask, -1e9),
        lambda: floats**2,
        lambda: torch.nn.functional.leaky_relu(floats, 0.1),
    ):
        assert _peak(_allocator_events(op)[:-1]) == _peak(_counted_events(op))


class _ScalarForm(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.form = nn.Linear(16, 256), form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.form == "rsub":
            return (1 - h).sum()  # rsub.Scalar
        if self.form == "remainder":
            return (h % 2).sum()  # remainder.Scalar
        return torch.xlogy(h, 2.0).sum()  # xlogy.Scalar_Other


@pytest.mark.parametrize("form", ["rsub", "remainder", "xlogy"])
def test_a_scalar_overload_s_own_number_at_the_peak(form):
    """The forward's last op is the step's peak: its kernel's number and cast (12 B) were missing (8-12 B low)."""
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    spec = loss_returning_spec(f"scalar-{form}", lambda: _ScalarForm(form), (16,))

    def build():  # type: ignore[no-untyped-def]
        model = _ScalarForm(form)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(BATCH, 16)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    assert simulate(trace_step(spec, settings)).peak_bytes == profiled_third_iteration_peak(build)
