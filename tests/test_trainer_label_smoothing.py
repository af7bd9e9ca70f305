"""--hf-args fields that change what transformers' Trainer runs in its step, against the Trainer itself on the CPU.

Each case runs the real Trainer (tests/hand_measure.py's trainer_third_step_peak: its third step, by the CPU
allocator's events) and memplan's prediction for the same file. The real run holds one micro-batch of inputs more
than memplan counts (accelerate fetches the next batch ahead, into host memory: tests/test_loops.py says why) and a
few of the Trainer's scalars."""

import json

import pytest

import memplan
from memplan.hf_args import read_training_args
from tests.hand_measure import trainer_third_step_peak

BATCH, SEQ_LEN = 4, 32
NEXT_BATCH = 2 * BATCH * SEQ_LEN * 8  # input_ids and labels, int64


def predicted_and_measured(model_dir, tmp_path, fields, auto_class="AutoModelForCausalLM"):
    arguments = tmp_path / "training_args.json"
    arguments.write_text(json.dumps({"per_device_train_batch_size": BATCH, **fields}))
    settings = read_training_args(arguments, device="cpu").settings  # what `--hf-args` reads from the file
    predicted = memplan.estimate(model_dir, **settings, seq_len=SEQ_LEN, device="cpu")
    measured = trainer_third_step_peak(
        model_dir, auto_class, seq_len=SEQ_LEN, per_device_train_batch_size=BATCH, **fields
    )
    return predicted, measured - NEXT_BATCH


@pytest.mark.parametrize(
    ("model", "auto_class", "fields"),
    [
        ("gpt2", "AutoModelForCausalLM", {}),
        ("llama", "AutoModelForCausalLM", {"bf16": True}),
        ("bert", "AutoModelForMaskedLM", {}),  # not a causal LM: the labels are not shifted
    ],
)
def test_label_smoothing_is_the_trainers_label_smoother(tiny_model_dirs, tmp_path, model, auto_class, fields):
    """label_smoothing_factor: the Trainer pops the labels and runs transformers' LabelSmoother on the logits (float32
    copies under amp), whose log_softmax is kept for the backward. memplan had read the file as if the model computed
    its own loss: 239,692 B low on GPT-2 and Llama (4.6 %, 6.3 %: the peak moves to the loss), 2,192 B on BERT."""
    fields = {"label_smoothing_factor": 0.1, **fields}
    predicted, measured = predicted_and_measured(tiny_model_dirs[model], tmp_path, fields, auto_class)
    assert predicted.settings.label_smoothing == 0.1
    assert 0 <= measured - predicted.peak_bytes <= 128, (measured, predicted.peak_bytes)


def test_activation_checkpointing_is_read_as_the_trainer_reads_it(tiny_model_dirs, tmp_path):
    """transformers 5's name for gradient_checkpointing (the old one is its deprecated alias): memplan had read only
    the alias, so a file with the new name was traced without checkpointing, 1,370,180 B (38 %) high."""
    from memplan.hf_args import training_argument_fields

    if "activation_checkpointing" not in training_argument_fields():  # the truth, the Trainer itself, refuses it
        pytest.skip("this transformers' TrainingArguments has gradient_checkpointing only")
    predicted, measured = predicted_and_measured(tiny_model_dirs["gpt2"], tmp_path, {"activation_checkpointing": True})
    assert predicted.settings.checkpoint == "all"
    assert 0 <= measured - predicted.peak_bytes <= 128, (measured, predicted.peak_bytes)


def test_what_label_smoothing_cannot_go_with_is_one_line(tiny_model_dirs, tmp_path):
    """A seq2seq model's decoder reads decoder_input_ids from the Trainer's collator once the labels are popped (its
    trace had failed inside the decoder: "You must specify exactly one of input_ids or inputs_embeds"); a --loss of
    one's own would replace the smoother (it had been ignored without a word); DeepSpeed's engine is not traced with
    it; and a --loop flag other than the Trainer's leaves the file's smoothing out, saying so (it had been refused)."""
    from click.testing import CliRunner

    from memplan.cli import main
    from memplan.errors import MemplanError

    with pytest.raises(MemplanError, match="seq2seq model.*DataCollatorForSeq2Seq"):
        memplan.estimate(tiny_model_dirs["t5"], seq_len=16, batch_size=2, device="cpu", loop="hf-trainer",
                         label_smoothing=0.1)  # fmt: skip
    with pytest.raises(MemplanError, match="loss and label smoothing"):
        memplan.estimate(tiny_model_dirs["gpt2"], seq_len=16, batch_size=2, device="cpu", loop="hf-trainer",
                         label_smoothing=0.1, loss="tests.zoo_models:mean_square_loss")  # fmt: skip
    with pytest.raises(MemplanError, match="under DeepSpeed's engine"):
        memplan.estimate(tiny_model_dirs["gpt2"], seq_len=16, batch_size=2, device="cpu", loop="hf-trainer",
                         label_smoothing=0.1, parallel="zero2", world_size=2)  # fmt: skip
    arguments = tmp_path / "smoothing.json"
    arguments.write_text(json.dumps({"per_device_train_batch_size": 2, "label_smoothing_factor": 0.1}))
    common = [tiny_model_dirs["gpt2"], "--seq-len", "16", "--device", "cpu", "--hf-args", str(arguments), "--json"]
    result = CliRunner().invoke(main, ["estimate", *common, "--loop", "canonical"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["settings"]["loop"] == "canonical" and answer["settings"]["label_smoothing"] == 0.0
    assert any("label_smoothing_factor is the Trainer's loss, left out" in note for note in answer["notes"])
