"""The notebook API: a model given as an object (real, meta or fake parameters, a factory or a
class) and a batch given as a tensor or a function, against the import-path route the CLI takes and
a real CPU run of the same step; the user's own model must come out untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memplan
from memplan.errors import InputsError, UsageError
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.zoo_models import TiedLM, tied_lm, token_inputs

SETTINGS = {"batch_size": 4, "device": "cpu"}


def test_every_form_of_the_model_gives_the_peak_of_a_real_run():
    spec = resolve_model("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs")
    settings = spec.settings_for(TrainingSettings(**SETTINGS))
    measured = measure_cpu(spec, settings).peak_bytes
    assert abs(simulate(trace_step(spec, settings)).peak_bytes / measured - 1) <= 0.005
    real = tied_lm()
    with torch.device("meta"):
        on_meta = TiedLM()
    with FakeTensorMode():
        faked = TiedLM()
    forms = {
        "real": (real, token_inputs),
        "meta": (on_meta, token_inputs),
        "fake": (faked, token_inputs),
        "factory": (tied_lm, token_inputs),
        "class": (TiedLM, token_inputs),
        "batch": (real, token_inputs(4)),  # the batch size is the batch's own
        "resized batch": (real, token_inputs(3)),  # rows repeated to batch_size=4
    }
    reference = memplan.estimate("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs", **SETTINGS)
    for form, (model, inputs) in forms.items():
        given = {"device": "cpu"} if form == "batch" else SETTINGS
        result = memplan.estimate(model, inputs=inputs, **given)
        assert result.settings.batch_size == 4, form
        assert result.peak_bytes == reference.peak_bytes, form
        assert result.parameter_count == sum(p.numel() for p in real.parameters()), form


def test_the_users_model_is_neither_copied_nor_changed():
    """A 100 GB Linear on the meta device is estimated without allocating it, and a real model's
    weights keep their values, dtype and ties through bf16 storage and LoRA adapters."""
    with torch.device("meta"):
        huge = nn.Linear(160_000, 160_000)  # 25.6 G parameters, 102 GB in float32
    result = memplan.estimate(huge, inputs=lambda size: torch.zeros(size, 160_000), device="cpu", loss=_sum)
    assert result.breakdown.parameters >= 4 * 160_000 * 160_000
    real = tied_lm()
    before = {name: tensor.clone() for name, tensor in real.state_dict().items()}
    memplan.estimate(real, inputs=token_inputs, precision="bf16", lora_rank=2, lora_targets="mix", **SETTINGS)
    after = real.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[name], before[name]) for name in before)
    assert real.head.weight is real.embed.weight and real.embed.weight.dtype == torch.float32
    assert all(p.requires_grad for p in real.parameters())  # peft froze its own copy, not this one


def _sum(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return output.sum()


def test_object_mistakes_are_one_line_errors():
    real = tied_lm()
    with pytest.raises(UsageError, match="a model object needs its batch"):
        memplan.estimate(real, device="cpu")
    with pytest.raises(UsageError, match="separate process, which cannot be handed Python objects"):
        memplan.validate(real, inputs=token_inputs, device="cpu")
    with pytest.raises(InputsError, match="one leading \\(batch\\) dimension"):
        memplan.estimate(real, inputs={"ids": torch.zeros(2, 8, dtype=torch.long), "mask": torch.zeros(3, 8)})
    with pytest.raises(UsageError, match="returned an int, not a torch.nn.Module"):
        memplan.estimate(lambda: 3, inputs=token_inputs, device="cpu")
    with pytest.raises(UsageError, match="size the inputs instead"):
        memplan.estimate(real, inputs=token_inputs, seq_len=64, device="cpu")
    with pytest.raises(UsageError, match="loss must be a function"):
        memplan.estimate(real, inputs=token_inputs, loss=3, device="cpu")


def test_a_model_that_cannot_run_at_half_the_batch_is_estimated_at_the_batch_asked(measure_in_this_process):
    """The per-sample slope's second trace ran at half the batch: at 1, where BatchNorm in training fails
    ("Expected more than 1 value per channel"), so estimate and validate stopped on a batch that runs. The
    slope is traced at twice the batch there; the prediction is the real CPU run's."""
    result = memplan.validate(
        "tests.zoo_models:batch_norm_mlp",
        inputs="tests.zoo_models:flat_inputs",
        loss="tests.zoo_models:mean_square_loss",
        batch_size=2,
        device="cpu",
    )
    assert result.error is None
    assert abs(result.predicted_peak_bytes - result.measured_peak_bytes) <= 0.005 * result.measured_peak_bytes


class _LabelledLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 64)
        self.head = nn.Linear(64, 512)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), labels.flatten())


def labelled_lm() -> nn.Module:
    return _LabelledLM()


def shared_ids(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 512, (batch_size, 256), generator=torch.Generator().manual_seed(0))
    return {"ids": ids, "labels": ids}


def test_one_tensor_under_two_names_in_a_batch_is_one_tensor():
    """`{"ids": t, "labels": t}`, a causal LM's usual batch, was resized entry by entry: two copies of t in the
    inputs where the step has one (4,096 B too many here). The estimate is the real run's, and the inputs
    function's, whose batch shares the tensor."""
    spec = resolve_model("tests.test_models_objects:labelled_lm", inputs="tests.test_models_objects:shared_ids")
    settings = spec.settings_for(TrainingSettings(**SETTINGS))
    measured = measure_cpu(spec, settings).peak_bytes
    given = memplan.estimate(_LabelledLM(), inputs=shared_ids(4), device="cpu")
    assert given.breakdown.inputs == 4 * 256 * 8  # one int64 batch
    assert abs(given.peak_bytes - measured) <= 16, (given.peak_bytes, measured)
    from_function = memplan.estimate(_LabelledLM(), inputs=shared_ids, **SETTINGS)
    assert given.peak_bytes == from_function.peak_bytes
