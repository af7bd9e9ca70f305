"""What training loops add around forward, backward and step, in a user's `--step`: predicted against the same
function run plainly on the CPU (no dispatch mode), measured by the CPU allocator's events (tests/hand_measure.py),
model, optimizer and batch made inside the measured run."""

from __future__ import annotations

import pytest
import torch

import tests.custom_steps as custom_steps
import tests.zoo_models as zoo_models
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak

BATCH = 4


def _measured(name: str, optimizer_name: str) -> int:
    step = getattr(custom_steps, name)

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = zoo_models.squared_linears()
        parameters = model.parameters()
        optimizer = torch.optim.AdamW(parameters) if optimizer_name == "adamw" else torch.optim.SGD(parameters, lr=1e-2)
        batch = zoo_models.named_features(BATCH)
        build.kept = (model, optimizer, batch)  # type: ignore[attr-defined]
        return lambda: step(model, batch, optimizer)

    return profiled_third_iteration_peak(build)


def _predicted(name: str, optimizer_name: str) -> int:
    spec = resolve_model("tests.zoo_models:squared_linears", inputs="tests.zoo_models:named_features")
    step = f"tests.custom_steps:{name}"
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer=optimizer_name, step=step)
    return simulate(trace_step(spec, spec.settings_for(settings))).peak_bytes


@pytest.mark.parametrize(
    ("name", "optimizer_name"),
    [
        # OptimizerLocals (memplan.estimator.held_tensors) kept the optimizer's locals, the gradients among them,
        # as tensors until the step returned: what the step ran after its zero_grad found the gradients still
        # there (+786,420 B, the three gradients, here).
        ("ema_after_zero_grad", "adamw"),
        # AveragedModel deepcopies the model: the copy's fake tensors went to another FakeTensorMode, counted as
        # constants live through the step and again as each op's conversion of them, each until its own update.
        # With SGD (no state) the update is the step's peak.
        ("ema_by_averaged_model", "sgd"),
        ("ema_by_averaged_model", "adamw"),
        # torch tests the norm with bool() (`error_if_nonfinite`): refused as data-dependent, the user's code blamed.
        ("clipped_failing_on_nonfinite", "adamw"),
    ],
)
def test_a_step_with_a_loops_extras_is_predicted_as_measured(name, optimizer_name):
    assert _predicted(name, optimizer_name) == _measured(name, optimizer_name)


def test_the_engine_sums_gradients_in_place_in_a_users_step_as_in_a_plain_run(tiny_model_dirs):
    """OptimizerLocals, a dispatch mode, was on the mode stack above memplan's through the whole of a --step: each op
    passed through it reached the trace with one more reference to each tensor (the arguments boxed again), so every
    sum of two gradients in the step's backward was taken for one the plain engine makes out of place. Here the
    log-softmax's two logits-sized gradients: +262,136 B (about one [128, 512] float32 buffer)."""
    import transformers

    model_dir, batch_size, seq_len = tiny_model_dirs["gpt2"], 2, 64
    step = custom_steps.class_weighted_smoothed_loss

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        config = transformers.AutoConfig.from_pretrained(model_dir)
        config.use_cache = False
        model = transformers.AutoModelForCausalLM.from_config(config).train()
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        batch = {"input_ids": ids, "labels": ids.clone()}
        build.kept = (model, optimizer, batch)  # type: ignore[attr-defined]
        return lambda: step(model, batch, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = resolve_model(model_dir)
    settings = spec.settings_for(
        TrainingSettings(
            batch_size=batch_size,
            seq_len=seq_len,
            device="cpu",
            optimizer="adamw",
            step="tests.custom_steps:class_weighted_smoothed_loss",
        )
    )
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured


# A step module as diffusers' training scripts write one: a noise schedule's table made at import, read by the step.
_NOISED_STEP_MODULE = """
import torch

ALPHAS_CUMPROD = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)


def noised(model, batch, optimizer):
    x = batch["x"]
    alphas = ALPHAS_CUMPROD[torch.randint(0, 1000, (x.shape[0],))].unsqueeze(1)
    noisy = alphas.sqrt() * x + (1 - alphas).sqrt() * torch.randn_like(x)
    model(x=noisy)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
"""


def test_a_step_modules_own_tensors_stay_real_after_an_estimate(tmp_path, monkeypatch):
    """memplan imported a --step module first inside its fake mode (at the untraced call), so the module's own tensors
    (a DDPMScheduler's alphas_cumprod made at import) were FakeTensors for good: the caller's process, holding the
    same module, then trained on fake tensors without an error (this run measured 3,149,848 B of 3,940,392; a small
    diffusers UNet2DConditionModel's 10.1 MB of 32.0). The estimate itself was right either way. Truth: the step run
    for real after the estimate, in the same process, as a notebook would; the estimate counts the 4,000 B table the
    step reads, made before the measurement."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensor

    import memplan

    (tmp_path / "memplan_noised_step.py").write_text(_NOISED_STEP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        predicted = memplan.estimate(
            "tests.zoo_models:squared_linears", inputs="tests.zoo_models:named_features", batch_size=BATCH,
            device="cpu", optimizer="adamw", step="memplan_noised_step:noised",
        )  # fmt: skip
        module = sys.modules["memplan_noised_step"]
        assert not isinstance(module.ALPHAS_CUMPROD, FakeTensor)

        def build():  # type: ignore[no-untyped-def]
            torch.manual_seed(0)
            model = zoo_models.squared_linears()
            optimizer = torch.optim.AdamW(model.parameters())
            batch = zoo_models.named_features(BATCH)
            build.kept = (model, optimizer, batch)  # type: ignore[attr-defined]
            return lambda: module.noised(model, batch, optimizer)

        measured = profiled_third_iteration_peak(build)
    finally:
        sys.modules.pop("memplan_noised_step", None)
    assert predicted.peak_bytes == measured + module.ALPHAS_CUMPROD.nbytes
