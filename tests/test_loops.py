"""`--loop`: each training loop people write, predicted against the same loop written out by hand
in plain PyTorch and run for real on the CPU (memplan's own loop code is on neither side)."""

from __future__ import annotations

import functools

import pytest
import torch

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import LOOPS, TrainingSettings
from tests import loop_mlp
from tests.hand_measure import measured_step_peak, profiled_third_iteration_peak, trainer_third_step_peak
from tests.zoo_models import tied_lm, token_inputs

BATCH = 8


def _step(loop: str, model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """One training step as each loop's users write it."""
    if loop == "canonical":  # `loss` bound, as docs/concepts.md writes it: its graph lives through the step
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elif loop == "zero-grad-before-backward":
        loss = model(**batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    elif loop == "set-to-none-false":
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    elif loop == "hf-trainer":  # Trainer.training_step returns loss.detach(): the graph goes before the step
        loss = model(**batch)["loss"]
        loss.backward()
        loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.zero_grad()
    elif loop == "keep-output":
        outputs = model(**batch)
        outputs["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        del outputs
    else:
        raise AssertionError(loop)


def _measured_peak(loop: str) -> int:
    torch.manual_seed(0)
    model = tied_lm()
    optimizer = torch.optim.AdamW(model.parameters())
    return measured_step_peak(functools.partial(_step, loop), model, token_inputs(BATCH), optimizer)


def _predicted_peak(loop: str) -> int:
    spec = resolve_model("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs")
    settings = spec.settings_for(TrainingSettings(batch_size=BATCH, device="cpu", loop=loop))
    return simulate(trace_step(spec, settings)).peak_bytes


@pytest.mark.parametrize("loop", LOOPS)
def test_each_loop_predicted_as_measured(loop):
    measured = _measured_peak(loop)
    assert _predicted_peak(loop) == pytest.approx(measured, rel=0.005, abs=16)


def test_the_loops_differ_where_they_should():
    # Measured, not predicted: the variants are worth telling apart on this model.
    peaks = {loop: _measured_peak(loop) for loop in LOOPS}
    assert peaks["set-to-none-false"] > peaks["canonical"]
    assert peaks["keep-output"] > peaks["canonical"]


def test_zero_grad_before_backward_starts_with_the_previous_gradients():
    # Its peak here falls where canonical's does; what differs is the forward, which runs with the
    # previous step's gradients still allocated: one float32 gradient per parameter.
    gradient_bytes = sum(param.numel() * 4 for param in tied_lm().parameters())
    spec = resolve_model("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs")
    starts = {
        loop: simulate(trace_step(spec, TrainingSettings(batch_size=BATCH, device="cpu", loop=loop))).timeline_bytes[0]
        for loop in ("canonical", "zero-grad-before-backward")
    }
    assert starts["zero-grad-before-backward"] - starts["canonical"] == gradient_bytes


def _real_trainer_peak(
    model_dir, batch_size: int, seq_len: int, bf16: bool, grad_accum: int = 1, fp16: bool = False
) -> int:
    """tests/hand_measure.py's trainer_third_step_peak over a causal LM."""
    return trainer_third_step_peak(
        model_dir, seq_len=seq_len, per_device_train_batch_size=batch_size, bf16=bf16, fp16=fp16,
        gradient_accumulation_steps=grad_accum,
    )  # fmt: skip


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_the_hf_trainer_loop_is_a_real_trainer_step(tiny_model_dirs, tmp_path, grad_accum):
    """`--hf-args` (bf16: amp-bf16 and the hf-trainer loop) against transformers' Trainer itself.

    The real run holds one more micro-batch of inputs: accelerate's DataLoaderShard fetches the next
    batch before it hands out the current one ("We iterate one batch ahead", accelerate/data_loader.py).
    The current batch goes to the device before the next is fetched, which stays on the host: on the
    CPU it is the same memory, on a GPU it is not, so memplan leaves it out. Besides it, a few scalars
    the Trainer keeps (72 B here). With accumulation the Trainer fetches the step's micro-batches before
    its first forward and holds them all, each on the device (`get_batch_samples`): memplan counted one
    (a helper's bug hunt: 2 micro-batches' inputs low at 3 steps)."""
    import json

    import memplan
    from memplan.hf_args import read_training_args

    arguments = tmp_path / "training_args.json"
    arguments.write_text(
        json.dumps({"per_device_train_batch_size": 4, "bf16": True, "gradient_accumulation_steps": grad_accum})
    )
    settings = read_training_args(arguments).settings  # what `--hf-args` reads from the file
    predicted = memplan.estimate(tiny_model_dirs["gpt2"], **settings, seq_len=32, device="cpu")
    assert (predicted.settings.precision, predicted.settings.loop) == ("amp-bf16", "hf-trainer")
    measured = _real_trainer_peak(tiny_model_dirs["gpt2"], 4, 32, bf16=True, grad_accum=grad_accum)
    next_batch = 2 * 4 * 32 * 8  # input_ids and labels, int64
    assert 0 <= measured - next_batch - predicted.peak_bytes <= 128, (measured, predicted.peak_bytes)


def test_fp16_in_a_trainer_file_is_float32_on_the_cpu_as_accelerate_runs_it(tiny_model_dirs, tmp_path):
    """accelerate turns fp16 off on the CPU without a word (its Accelerator makes no GradScaler and no autocast
    there): memplan had predicted amp-fp16 for the cpu target, 0.39% high against the real Trainer (a helper's bug
    hunt). The same relation to the real step as test_the_hf_trainer_loop_is_a_real_trainer_step's."""
    import json

    import memplan
    from memplan.hf_args import read_training_args

    arguments = tmp_path / "training_args.json"
    arguments.write_text(json.dumps({"per_device_train_batch_size": 4, "fp16": True}))
    settings = read_training_args(arguments, device="cpu").settings
    predicted = memplan.estimate(tiny_model_dirs["gpt2"], **settings, seq_len=32, device="cpu")
    measured = _real_trainer_peak(tiny_model_dirs["gpt2"], 4, 32, bf16=False, fp16=True)
    next_batch = 2 * 4 * 32 * 8  # input_ids and labels, int64
    assert 0 <= measured - next_batch - predicted.peak_bytes <= 128, (measured, predicted.peak_bytes)


def _keep_output_peak(model_of, batch_of, batch_size: int) -> int:
    """The keep-output loop as docs/concepts.md writes it (`out = model(...)`, `loss_fn(out).backward()`, `del out`
    after the step), AdamW, its third iteration by the CPU allocator's events, no dispatch mode."""

    def build():
        torch.manual_seed(0)
        model = model_of().train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = batch_of(batch_size)
        build.kept = (model, optimizer, batch)

        def iteration() -> None:
            out = model(**batch)
            loss = out.loss if hasattr(out, "loss") else loop_mlp.cross_entropy(out, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del out

        return iteration

    return profiled_third_iteration_peak(build)


def test_keep_output_holds_the_output_through_the_step():
    """The output lives until `del out` after the step: where the peak is the optimizer's (a small batch, AdamW),
    memplan had freed it when the backward ended (16,388 B low here: the 8 × 512 float32 logits)."""
    import memplan

    predicted = memplan.estimate(
        "tests.loop_mlp:three_layer", inputs="tests.loop_mlp:rows", loss="tests.loop_mlp:cross_entropy",
        batch_size=8, device="cpu", loop="keep-output",
    )  # fmt: skip
    assert predicted.phase == "optimizer"
    measured = _keep_output_peak(loop_mlp.three_layer, loop_mlp.rows, 8)
    assert 0 <= measured - predicted.peak_bytes <= 8, (measured, predicted.peak_bytes)  # the previous loss, 4 B


def test_keep_output_holds_a_hugging_face_models_key_value_cache():
    """A model object keeps its config: GPT-2's `use_cache` on fills a DynamicCache in training, copies of each
    layer's keys and values that the kept output holds through the backward; memplan had let them go at their last
    use (131,072 B low here)."""
    import memplan

    predicted = memplan.estimate(
        "tests.loop_mlp:tiny_gpt2_with_cache", inputs="tests.loop_mlp:tokens", batch_size=8, device="cpu",
        loop="keep-output",
    )  # fmt: skip
    measured = _keep_output_peak(loop_mlp.tiny_gpt2_with_cache, loop_mlp.tokens, 8)
    assert 0 <= measured - predicted.peak_bytes <= 8, (measured, predicted.peak_bytes)
