"""A factory that returns `torch.compile(model)`, or compiles a layer inside it: traced as the eager model it wraps
(memplan.estimator.compiled), and said so in a note.

Truth: the eager model's step run for real on the CPU with no dispatch mode active, measured by the CPU allocator's
own events (tests/hand_measure.py). Before memplan.estimator.compiled, TorchDynamo compiled frames under the trace,
memplan's own dispatch modes' Python among them (71 frames for this MLP: 20 s instead of 2, and a page of
recompile-limit warnings), and the estimate did not say that it was not the compiled step's memory.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import memplan
from tests.compiled_models import Mlp, rows
from tests.hand_measure import profiled_third_iteration_peak, training_iteration

BATCH = 8
CPU_MEAN_INTERNALS = 12  # the allocator's 8 B and 4 B inside a CPU `mean` (tests/test_plain_formulas.py)


def _eager_measured_peak() -> int:
    def build():
        torch.manual_seed(0)
        model = Mlp()
        optimizer = torch.optim.AdamW(model.parameters())
        return training_iteration(model, rows(BATCH), lambda out, _: out, optimizer)

    return profiled_third_iteration_peak(build)


@pytest.mark.parametrize(
    ("factory", "named"), [("compiled_mlp", "the model is torch.compile'd"), ("mlp_with_a_compiled_layer", "up is")]
)
def test_a_compiled_model_is_traced_as_its_eager_original(factory, named):
    frames = counters["frames"]["total"]
    result = memplan.estimate(
        f"tests.compiled_models:{factory}", inputs="tests.compiled_models:rows", batch_size=BATCH, device="cpu"
    )
    assert counters["frames"]["total"] == frames  # nothing compiled under the trace
    measured = _eager_measured_peak()
    assert measured - CPU_MEAN_INTERNALS <= result.peak_bytes <= measured
    [note] = [note for note in result.notes if "torch.compile" in note]
    assert named in note and "eager" in note


def test_an_eager_model_has_no_compile_note():
    result = memplan.estimate("tests.compiled_models:mlp", inputs="tests.compiled_models:rows", batch_size=BATCH)
    assert not [note for note in result.notes if "torch.compile" in note]
