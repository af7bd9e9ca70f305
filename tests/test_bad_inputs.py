"""User mistakes: each answered in one line, with the right exit code, and nothing the user gave touched.

Every CLI case runs the real command line (in-process) in a folder of the user's files, and checks:
the exit code (2 for a usage mistake, 1 for a failure of the work), a single "memplan: error: ..."
line on stderr naming what is wrong (click's own errors too: memplan.cli prints them in one line), no
traceback, no "internal error", and
every file in the folder byte-for-byte what it was (nothing written, nothing lost). Every API case
checks the same of the Python functions: a `MemplanError` with that exit code and a one-line
message, never a TypeError or AttributeError from deep inside. The models are tiny (tiny-gpt2,
tests/bad_models.py), so the catalogue runs in seconds.
"""

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from torch import nn

import memplan
from memplan.cli import main
from memplan.errors import MemplanError

TINY = ["--device", "cpu", "--seq-len", "32"]
MLP = ["tests.bad_models:mlp", "--inputs", "tests.bad_models:inputs", "--device", "cpu"]
VECTOR = ["tests.bad_models:returns_vector", "--inputs", "tests.bad_models:inputs", "--device", "cpu"]
BUDGET = ["--budget", "1GiB"]


def _inputs(name: str) -> list[str]:
    return ["tests.bad_models:mlp", "--inputs", f"tests.bad_models:{name}", "--device", "cpu"]


def _factory(name: str) -> list[str]:
    return [f"tests.bad_models:{name}", "--inputs", "tests.bad_models:inputs", "--device", "cpu"]


# The user's folder: inputs that are wrong in one way each, and outputs that must not be overwritten.
FILES = {
    "empty.json": "{}",
    "not-json.json": "garbage",
    "unknown-type.json": json.dumps({"model_type": "no-such-architecture"}),
    "heads-do-not-divide.json": json.dumps({"model_type": "gpt2", "n_head": 5, "n_embd": 64, "n_layer": 1}),
    "negative-layers.json": json.dumps({"model_type": "gpt2", "n_layer": -1, "n_embd": 64, "n_head": 4}),
    "zero-vocab.json": json.dumps({"model_type": "gpt2", "vocab_size": 0, "n_layer": 1, "n_embd": 64, "n_head": 4}),
    "list.json": "[1, 2]",
    # a field of the wrong type, and a value the architecture does not know: "internal error", exit 1, had been said
    "word-layers.json": json.dumps({"model_type": "gpt2", "n_layer": "two", "n_embd": 64, "n_head": 4}),
    "unknown-activation.json": json.dumps(
        {"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 4, "activation_function": "nope"}
    ),
    # GPT-2 calls it n_layer: transformers kept n_layers as an attribute and built the default 12 layers
    "layers-typo.json": json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layers": 2, "n_head": 4}),
    # memplan's own preset file, copied to edit: its fields under "config" built a full-size GPT-2
    "preset-copy.json": json.dumps({"model_type": "gpt2", "task": "causal-lm", "config": {"n_embd": 64, "n_layer": 2}}),
    "my_model.py": "def build():\n    pass\n",
    "tiny-vit.json": json.dumps(
        {
            "model_type": "vit",
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "image_size": 32,
            "patch_size": 8,
        }  # fmt: skip
    ),
    "training-args-typo.json": json.dumps({"per_device_train_batch_size": 4, "gradient_acumulation_steps": 2}),
    "args.json": json.dumps({"per_device_train_batch_size": 2}),
    "args-negative.json": json.dumps({"per_device_train_batch_size": -3}),
    "args-word.json": json.dumps({"per_device_train_batch_size": "four"}),
    "args-lion.json": json.dumps({"optim": "lion_32bit"}),
    "args.yaml": "per_device_train_batch_size: [\n",
    "plan-garbage.json": "garbage",
    "plan-other-format.json": json.dumps({"format": "something-else", "version": 1}),
    "existing.png": "the user's picture",
    "existing.json": "{}",
    "existing.pickle": "the user's snapshot",
}


def case(args, words, code=2):
    return pytest.param(args, words, code, id=" ".join(args)[:120])


CLI_CASES = [
    # --- presets and the command line itself
    case(["presets", "extra"], ["unexpected extra argument"]),
    case(["presets", "--bogus"], ["No such option"]),
    case(["nosuchcommand"], ["No such command"]),
    case(["estimate"], ["Missing argument 'MODEL'"]),
    case(["estimate", "gpt2", "--bogus"], ["No such option"]),
    # --- where the model comes from
    case(["estimate", "empty.json"], ["no model_type"]),
    case(["estimate", "not-json.json"], ["cannot read", "JSON"]),
    case(["estimate", "list.json"], ["no model_type"]),
    case(["estimate", "layers-typo.json", *TINY], ["'n_layers' is not a field", "n_layer (12)", "'n_layer'?"]),
    case(["estimate", "preset-copy.json", *TINY], ["is a memplan preset file", "at the top level"]),
    case(["estimate", "unknown-type.json"], ["transformers cannot load", "no-such-architecture"]),
    case(["estimate", "heads-do-not-divide.json", "-b", "1", "--seq-len", "8"], ["cannot build", "fix the config"]),
    case(["estimate", "negative-layers.json", *TINY], ["num_hidden_layers (n_layer) = -1", "fix the config"]),
    case(["estimate", "zero-vocab.json", *TINY], ["vocab_size = 0", "fix the config"]),
    case(["estimate", "word-layers.json", *TINY], ["transformers cannot load", "'n_layer' expected int"]),
    case(["estimate", "unknown-activation.json", *TINY], ["names 'nope'", "fix the config"]),
    case(["estimate", "empty-dir"], ["no config.json"]),
    case(["estimate", "missing.json"], ["no file or folder missing.json"]),
    case(["estimate", "./no-such-folder"], ["no file or folder ./no-such-folder"]),
    case(["estimate", "my_model.py"], ["my_model.py is Python source", "module:function"]),
    case(["estimate", ""], ["unknown model ''"]),
    case(["estimate", "gpt-2"], ["did you mean gpt2"]),
    case(["estimate", "nosuchmodel"], ["unknown model 'nosuchmodel'", "memplan presets"]),
    case(["estimate", "meta-llama/Llama-3.1-13B"], ["did you mean", "llama-3.1-8b"]),
    case(["estimate", "someorg/gpt2-mediun"], ["did you mean gpt2-medium"]),
    case(["estimate", "tiny-gpt2", "--task", "translation", *TINY], ["--task must be one of", "'translation'"]),
    case(["estimate", "tiny-vit.json", "--image-size", "48", "--device", "cpu"], ["takes 32×32", "--image-size 32"]),
    # images smaller than the patch: ATen's convolution refuses them; it had been "cannot trace", status 1
    case(["estimate", "tiny-vit.json", "--image-size", "4", "--device", "cpu"], ["--image-size", "8 x 8 kernel"]),
    case(["estimate", "tiny-gpt2", "--task", "image-classification", "--device", "cpu"], ["cannot build", "--task"]),
    case(["estimate", "tiny-gpt2", "--task", "seq2seq", *TINY], ["cannot build", "--task"]),
    case(["estimate", "tiny-gpt2", "--inputs", "tests.bad_models:inputs"], ["--inputs", "drop --inputs"]),
    case(["estimate", "gpt2", "--inputs", "tests.zoo_models:features_inputs"], ["--inputs", "drop --inputs"]),
    # it had been named PYTORCH_CUDA_ALLOC_CONF, whichever of the flag and the two variables gave it
    case(["estimate", "tiny-gpt2", "--cuda-alloc-conf", "bogus"], ["cannot read the allocator configuration 'bogus'"]),
    # a custom model misspelt: "drop --inputs" had been said, which only leads to "unknown model"
    case(["estimate", "tests/bad_models.py:mlp", "--inputs", "tests.bad_models:inputs"], ["tests.bad_models:mlp?"]),
    case(["estimate", "tests.bad_models.mlp", "--inputs", "tests.bad_models:inputs"], ["tests.bad_models:mlp?"]),
    case(["estimate", "tiny-gpt2", "--loss", "tests.bad_models:nosuch", *TINY], ["no attribute 'nosuch'"]),
    case(["estimate", "tiny-gpt2", "--loss", "tests.bad_models:loss_float", *TINY], ["must return a scalar tensor"]),
    case(["estimate", "tiny-gpt2", "--loss", "nocolon", *TINY], ["not of the form package.module:name"]),
    # --- a custom model, its factory, inputs and loss
    case(["estimate", "tests.nosuch:mlp", "--inputs", "tests.bad_models:inputs"], ["cannot import module"]),
    case(["estimate", "tests.bad_models:nosuch", "--inputs", "tests.bad_models:inputs"], ["no attribute 'nosuch'"]),
    case(["estimate", "tests.bad_models:NOT_CALLABLE", "--inputs", "tests.bad_models:inputs"], ["not a callable"]),
    case(["estimate", "tests.bad_models:mlp"], ["needs its batch", "--inputs"]),
    case(["estimate", *MLP, "--step", "tests.bad_models:step_without_optimizer"], ["must take three arguments"]),
    case(
        ["estimate", *MLP, "--step", "tests.custom_steps:two_views", "--loss", "tests.zoo_models:mean_square_loss"],
        ["--step runs your whole iteration", "leave out --loss"],
    ),
    case(
        [
            "estimate",
            "tiny-gpt2",
            *TINY,
            "--step",
            "tests.custom_steps:two_views",
            "--loss",
            "tests.bad_models:loss_float",
        ],
        ["leave out --loss"],
    ),
    case(["estimate", "tests.bad_models:mlp", "--inputs", "nocolon"], ["not of the form"]),
    case(["estimate", "tests.bad_models:mlp", "--inputs", "tests.bad_models:nosuch"], ["no attribute 'nosuch'"]),
    case(["estimate", *_inputs("inputs_two_arguments")], ["must take one argument"]),
    case(["estimate", *_factory("not_a_module")], ["returned a str, not a torch.nn.Module"]),
    case(["estimate", *_factory("returns_class")], ["returned a type"]),
    case(["estimate", *_factory("factory_needs_argument")], ["callable with no arguments", "width"]),
    case(["estimate", *_factory("factory_raises")], ["factory_raises' raised ValueError", "--debug"], code=1),
    case(["plan", *_factory("factory_raises"), *BUDGET], ["factory_raises' raised ValueError"], code=1),
    # sys.exit() in the user's code had ended memplan with its code (0 for none) and no answer (CLI bug hunt, M3)
    case(
        ["estimate", *_factory("jit_traced")],
        ["jit_traced' calls torch.jit.trace", "return the eager nn.Module", "check_trace=False"],
        code=1,
    ),
    case(["estimate", *_factory("factory_exits")], ["factory_exits' called sys.exit(3)", "no answer"], code=1),
    case(["estimate", *_factory("exits_in_forward")], ["exits_in_forward called sys.exit(None)"], code=1),
    case(["compare", *_factory("inputs_raise")], ["callable with no arguments"]),
    case(["estimate", *_inputs("inputs_raise")], ["inputs_raise' raised RuntimeError"], code=1),
    case(["estimate", *_inputs("list_inputs")], ["returned a list"]),
    case(["estimate", *_inputs("none_inputs")], ["returned a NoneType"]),
    case(["estimate", *_inputs("numpy_like_inputs")], ["returned a list"]),
    case(["estimate", *_inputs("wrong_shape_inputs")], ["cannot trace", "wrong_shape_inputs", "(1, 11)"], code=1),
    case(["estimate", *_inputs("wrong_shape_inputs")[:-2]], ["wrong_shape_inputs", "(1, 11)"], code=1),
    case(["sweep", *_inputs("wrong_shape_inputs"), "--batch-sizes", "1"], ["wrong_shape_inputs"], code=1),
    case(["estimate", *_inputs("keyword_inputs")], ["unexpected keyword argument 'y'", "keyword_inputs"], code=1),
    case(["estimate", *_inputs("too_many_inputs")], ["3 were given", "too_many_inputs"], code=1),
    case(["estimate", *_factory("returns_none")], ["no scalar `loss`", "--loss"]),
    case(["estimate", *_factory("returns_vector")], ["not a scalar loss", "--loss"]),
    case(["estimate", *_factory("raises_in_forward")], ["cannot trace", "the user's forward is broken"], code=1),
    # it had said "outside any module (loss or optimizer)" (a helper's bug hunt)
    case(["estimate", *_factory("mask_filled_with_a_parameter")], ["aten.nonzero", "in the backward pass"], code=1),
    # a value-sized op: where in the user's code, what it is there, and a fixed-shape way (a helper's bug hunt: it had
    # named aten.nonzero alone, which `y[mask]` does not spell, and said "make that code shape-only")
    case(
        ["estimate", *_factory("masked_rows_loss")],
        ["aten.nonzero", "bad_models.py:", "y[x[:, 0] > 0]", "boolean-mask index", "ignore_index=-100"],
        code=1,
    ),
    case(["estimate", *_factory("repeated_rows")], ["aten.repeat_interleave", "output_size="], code=1),
    case(["estimate", *_factory("no_grad")], ["does not depend on any parameter that trains", "no_grad"]),
    # autograd's "element 0 of tensors does not require grad", exit 1, before
    case(["estimate", *_factory("all_frozen")], ["all_frozen has no trainable parameter", "unfreeze"]),
    case(["estimate", *_factory("no_parameters")], ["no_parameters has no trainable parameter"]),
    case(["estimate", *MLP, "--loss", "tests.bad_models:nosuch"], ["no attribute 'nosuch'"]),
    case(["estimate", *VECTOR, "--loss", "tests.bad_models:loss_not_scalar"], ["scalar", "shape (1, 3)"]),
    case(["estimate", *VECTOR, "--loss", "tests.bad_models:loss_float"], ["must return a scalar tensor, got float"]),
    case(["estimate", *VECTOR, "--loss", "tests.bad_models:loss_one_argument"], ["must take two arguments"]),
    case(["estimate", *VECTOR, "--loss", "tests.bad_models:loss_raises"], ["the loss function --loss", "KeyError"], 1),
    # raised in torch under the loss, by a fake tensor's limit: not the loss's own mistake
    case(["estimate", *VECTOR, "--loss", "tests.bad_models:loss_reading_values"], ["cannot trace", "in the loss"], 1),
    case(
        [
            "estimate",
            "tests.zoo_models:data_dependent",
            "--inputs",
            "tests.zoo_models:features_inputs",
            "--device",
            "cpu",
        ],
        ["depends on tensor values"],
        code=1,
    ),
    case(["estimate", *MLP, "--attn-impl", "eager"], ["--attn-impl eager", "contains none"]),
    case(["estimate", *MLP, "--task", "causal-lm"], ["--task", "drop --task"]),
    case(["estimate", *MLP, "--image-size", "32"], ["--image-size", "size it there"]),
    case(
        [
            "estimate",
            "tests.zoo_models:reused_block",
            "--inputs",
            "tests.zoo_models:features_inputs",
            "--loss",
            "tests.zoo_models:mean_square_loss",
            "--seq-len",
            "5",
        ],
        ["--seq-len", "--inputs tests.zoo_models:features_inputs"],
    ),
    # --- training settings
    case(["estimate", "tiny-gpt2", "-b", "0", "--device", "cpu"], ["batch size must be a positive integer, got 0"]),
    case(["estimate", "tiny-gpt2", "-b", "-1", "--device", "cpu"], ["batch size must be a positive integer"]),
    case(["estimate", "tiny-gpt2", "-b", "abc"], ["'abc' is not a valid integer"]),
    case(["estimate", "tiny-gpt2", "-b", "1e20"], ["'1e20' is not a valid integer"]),
    case(["estimate", "tiny-gpt2", "-b", "2.5"], ["'2.5' is not a valid integer"]),
    case(["estimate", "gpt2", "-b", "100000000000000000000"], ["batch size", "at most 1,048,576"]),
    case(["estimate", "gpt2", "--grad-accum", "2000000"], ["gradient accumulation", "at most"]),
    case(["estimate", "tiny-gpt2", "--grad-accum", "0", "--device", "cpu"], ["gradient accumulation steps"]),
    case(["estimate", "tiny-gpt2", "--seq-len", "0", "--device", "cpu"], ["sequence length must be a positive"]),
    case(["estimate", "tiny-gpt2", "--seq-len", "-3", "--device", "cpu"], ["sequence length must be a positive"]),
    case(["estimate", "tiny-gpt2", "--seq-len", "100000", "--device", "cpu"], ["maximum of 128 positions"]),
    case(["estimate", "tiny-gpt2", *TINY, "--target-len", "8"], ["--target-len has no place", "causal-lm"]),
    case(["estimate", "tiny-gpt2", *TINY, "--image-size", "32"], ["--image-size has no place", "drop --image-size"]),
    case(["estimate", "tiny-gpt2", *TINY, "--target-len", "0"], ["target length must be a positive"]),
    case(["estimate", "tiny-gpt2", "--precision", "fp8"], ["'fp8' is not one of"]),
    case(["estimate", "tiny-gpt2", "--optimizer", "lion"], ["'lion' is not one of"]),
    case(["estimate", "tiny-gpt2", "--optimizer-impl", "fused", "--optimizer", "adafactor"], ["no fused"]),
    case(["estimate", "tiny-gpt2", "--optimizer-impl", "foreach", "--optimizer", "adam8bit"], ["bitsandbytes' own"]),
    case(["estimate", "tiny-gpt2", "--optimizer-impl", "for-loop", "--optimizer", "none"], ["runs no optimizer"]),
    case(["estimate", "tiny-gpt2", "--device", "tpu"], ["'tpu' is not one of"]),
    case(["estimate", "tiny-gpt2", "--loop", "sometimes"], ["'sometimes' is not one of"]),
    case(["estimate", "tiny-gpt2", "--attn-impl", "flash"], ["'flash' is not one of"]),
    case(["estimate", "tiny-gpt2", "--gpu", "NoSuchGPU"], ["unknown GPU 'NoSuchGPU'", "known:"]),
    case(["estimate", "gpt2", "--gpu", "A100-80GB", "--device", "cpu"], ["--gpu", "--device cpu", "--budget"]),
    case(["estimate", "tiny-gpt2", "--cuda-context", "1GiB", "--device", "cpu"], ["--cuda-context", "--device cpu"]),
    case(["estimate", "tiny-gpt2", "--cuda-context", "abc"], ["cannot read 'abc' as a size"]),
    case(["estimate", "tiny-gpt2", "--cuda-context", "0.5B"], ["0 or at least one byte"]),
    case(["estimate", "tiny-gpt2", "--gpu", "T4", "--cuda-context", "20GiB"], ["T4 has 15.00 GiB", "--cuda-context"]),
    case(["plan", "tiny-gpt2", "--gpu", "T4", "--cuda-context", "15GiB"], ["nothing is left", "--cuda-context"]),
    case(["estimate", "tiny-gpt2", "--gpu", "T4,H100-80GB", "--cuda-context", "20GiB"], ["T4 has 15.00 GiB"]),
    case(["estimate", "tiny-gpt2", "--cudnn-benchmark", "--device", "cpu"], ["--cudnn-benchmark", "--device cpu"]),
    case(["estimate", "tiny-gpt2", "--no-cudnn-tf32", "--device", "cpu"], ["--no-cudnn-tf32", "--device cpu"]),
    case(["estimate", "tiny-gpt2", "--cudnn-workspace-cap", "-1"], ["not in the range x>=0"]),
    case(["estimate", "tiny-gpt2", "--cublas-workspace-config", "garbage"], ["CUBLAS_WORKSPACE_CONFIG 'garbage'"]),
    case(["estimate", "tiny-gpt2", "--budget", "0"], ["at least one byte"]),
    case(["estimate", "tiny-gpt2", "--budget", "-5GiB"], ["cannot read '-5GiB' as a size"]),
    case(["estimate", "tiny-gpt2", "--budget", "1XB"], ["cannot read '1XB' as a size"]),
    case(["estimate", "tiny-gpt2", "--budget", "0.1"], ["at least one byte"]),
    case(["estimate", "tiny-gpt2", *TINY, "--checkpoint", "sometimes"], ["sometimes is not one of", "a plan file"]),
    case(["estimate", "tiny-gpt2", *TINY, "--checkpoint", "All"], ["All is not one of", "did you mean all?"]),
    case(["estimate", "tiny-gpt2", *TINY, "--checkpoint", "plan-garbage.json"], ["is not JSON"]),
    case(["estimate", "tiny-gpt2", *TINY, "--checkpoint", "plan-other-format.json"], ["not a memplan checkpoint plan"]),
    case(["estimate", "tiny-gpt2", *TINY, "--checkpoint", "empty-dir"], ["cannot read plan empty-dir"]),
    # --- TrainingArguments files
    case(["estimate", "gpt2", "--hf-args", "training-args-typo.json"], ["did you mean 'gradient_accumulation_steps'"]),
    case(["estimate", "tiny-gpt2", *TINY, "--hf-args", "missing.json"], ["cannot read --hf-args missing.json"]),
    case(["estimate", "tiny-gpt2", *TINY, "--hf-args", "not-json.json"], ["not valid JSON"]),
    case(["estimate", "tiny-gpt2", *TINY, "--hf-args", "args-negative.json"], ["must be a positive integer, got -3"]),
    case(["estimate", "tiny-gpt2", *TINY, "--hf-args", "args-word.json"], ["got 'four'"]),
    case(["estimate", "tiny-gpt2", *TINY, "--hf-args", "args-lion.json"], ["cannot model optim 'lion_32bit'"]),
    case(["estimate", "tiny-gpt2", *TINY, "--hf-args", "args.yaml"], ["not valid YAML"]),
    case(["estimate", "tiny-gpt2", *TINY, "--hf-args", "empty-dir"], ["is a directory"]),
    # --- output files: never overwritten, never half-written, never an input
    case(["estimate", "tiny-gpt2", *TINY, "--plot", "missing-dir/out.png"], ["folder missing-dir does not exist"]),
    case(["estimate", "tiny-gpt2", *TINY, "--plot", "existing.png"], ["exists", "--force"]),
    case(["estimate", "tiny-gpt2", *TINY, "--plot", "args.json", "--hf-args", "args.json"], ["also an input"]),
    case(["estimate", "tiny-gpt2", *TINY, "--plot", "out.txt"], ["name a .png"]),
    case(["estimate", "tiny-gpt2", *TINY, "--plot", "empty-dir"], ["is a directory"]),
    case(["estimate", "tiny-gpt2", *TINY, "--snapshot", "out.pickle"], ["--snapshot", "--device cuda"]),
    case(["estimate", "tiny-gpt2", "--snapshot", "existing.pickle"], ["exists", "--force"]),
    case(["estimate", "tiny-gpt2", "--snapshot", "missing-dir/s.pickle"], ["folder missing-dir does not exist"]),
    case(["estimate", "tiny-gpt2", "--snapshot", "args.json", "--hf-args", "args.json"], ["also an input"]),
    # --- plan
    case(["plan", "tiny-gpt2", *TINY], ["needs a budget"]),
    case(["plan", "tiny-gpt2", "--gpu", "T4,L4"], ["--gpu 'T4,L4' names several cards", "`memplan estimate` compares"]),
    case(["plan", "gpt2", "--gpu", "A100-80GB", "--device", "cpu", "--budget", "1GiB"], ["--gpu", "--device cpu"]),
    case(["plan", "tiny-gpt2", *TINY, "--budget", "abc"], ["cannot read 'abc' as a size"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "--candidates", "("], ["not a valid regular expression"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "--candidates", r"nothing\.here"], [r"'nothing\.here' matches"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "--solver", "magic"], ["'magic' is not one of"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "--jobs", "0"], ["not in the range x>=1"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "-o", "existing.json"], ["exists", "--force"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "-o", "missing-dir/plan.json"], ["folder missing-dir does not exist"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "-o", "args.json", "--hf-args", "args.json"], ["also an input"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "-o", "empty-dir"], ["is a directory"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "--checkpoint", "all"], ["No such option '--checkpoint'"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "--maximize-batch", "-b", "4"], ["leave out --batch-size"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "--maximize-batch", "--selective"], ["--selective"]),
    case(["plan", "tiny-gpt2", *TINY, *BUDGET, "--maximize-batch"], ["--device cuda"]),
    case(["plan", "tiny-gpt2", "--seq-len", "32", *BUDGET, "--gpu", "NoSuch"], ["unknown GPU"]),
    case(["plan", *MLP, *BUDGET], ["no repeated blocks", "--candidates"]),
    case(["plan", "nosuchmodel", *BUDGET], ["unknown model"]),
    # --- sweep
    case(["sweep", "tiny-gpt2", "-b", "4", *TINY], ["--batch-sizes", "--batch-size is for one configuration"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "a,b", *TINY], ["comma-separated integers", "'a,b'"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1,,2", *TINY], ["comma-separated integers", "'1,,2'"]),
    case(["sweep", "tiny-gpt2", "--precisions", "fp32,,bf16", *TINY], ["--precisions takes a comma-separated list"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "", *TINY], ["positive integers"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "0,1", *TINY], ["positive integers"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1.5", *TINY], ["'1.5'"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1,2,1", *TINY], ["names 1 more than once"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "100000000000000000000", *TINY], ["at most 1,048,576"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1", "--precisions", "fp8", *TINY], ["--precisions", "fp8"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1", "--precisions", ",", *TINY], ["--precisions", "','"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1", "--checkpoints", "sometimes", *TINY], ["--checkpoints"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1", "--plot", "existing.png", *TINY], ["exists", "--force"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1", "--plot", "out.txt", *TINY], ["name a .png"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1", "--budget", "0", *TINY], ["at least one byte"]),
    case(["sweep", "tiny-gpt2", "--batch-sizes", "1", "--gpu", "T4", *TINY], ["--gpu", "--device cpu"]),
    case(["sweep", "nosuchmodel"], ["unknown model"]),
    # --- compare
    case(["compare", "tiny-gpt2", "--gpus", "0", *TINY], ["--gpus must be a positive integer, got 0"]),
    case(["compare", "tiny-gpt2", "--gpus", "-1", *TINY], ["--gpus must be a positive integer"]),
    case(["compare", "tiny-gpt2", "--gpus", "abc", *TINY], ["'abc' is not a valid integer"]),
    case(["compare", "tiny-gpt2", "--budget", "abc", *TINY], ["cannot read 'abc' as a size"]),
    case(["compare", "tiny-gpt2", "--plot", "x.png", *TINY], ["No such option '--plot'"]),
    case(["compare", "tiny-gpt2", "-b", "0", *TINY], ["batch size must be a positive integer"]),
    case(["compare", "nosuchmodel"], ["unknown model"]),
    # --- validate
    case(["validate"], ["name a MODEL"]),
    case(["validate", "gpt2", "--suite", "main"], ["--suite main", "drop MODEL"]),
    case(["validate", "--suite", "nosuch", "--device", "cpu"], ["unknown suite 'nosuch'"]),
    case(["validate", "--suite", "smoke", "--device", "cpu", "--results", "missing-dir/r.json"], ["does not exist"]),
    case(["validate", "--suite", "smoke", "--device", "cpu", "--results", "existing.json"], ["exists", "--resume"]),
    case(["validate", "--suite", "smoke", "--device", "cpu", "--results", "empty-dir"], ["is a directory"]),
    case(["validate", "tiny-gpt2", *TINY, "--results", "r.json"], ["--results is for a --suite run"]),
    case(["validate", "tiny-gpt2", *TINY, "--resume"], ["--resume is for a --suite run"]),
    case(["validate", "gpt2", "--warmup", "0", "--device", "cpu"], ["--warmup"]),
    case(["validate", "gpt2", "--warmup", "-1", "--device", "cpu"], ["--warmup"]),
    case(["validate", "gpt2", "--warmup", "abc", "--device", "cpu"], ["--warmup"]),
    case(["validate", "gpt2", "--timeout", "-5", "--device", "cpu"], ["--timeout"]),
    case(["validate", "gpt2", "--timeout", "0", "--device", "cpu"], ["--timeout"]),
    case(["validate", "tiny-gpt2", *TINY, "--snapshot", "s.pickle"], ["--snapshot", "--device cuda"]),
    case(["validate", "tiny-gpt2", *TINY, "--snapshot", "existing.pickle"], ["exists", "--force"]),
    case(["validate", "tiny-gpt2", *TINY, "--checkpoint", "missing.json"], ["cannot read plan missing.json"]),
    case(["validate", "tiny-gpt2", *TINY, "-b", "0"], ["batch size must be a positive integer"]),
    case(["validate", "tiny-gpt2", *TINY, "--budget", "1GiB"], ["No such option '--budget'"]),
    case(["validate", "tests.bad_models:mlp", "--device", "cpu"], ["needs its batch"]),
    case(["validate", "nosuchmodel", "--device", "cpu"], ["unknown model"]),
]


def _fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        for path in sorted(folder.rglob("*"))
    }


@pytest.fixture
def users_folder(tmp_path, monkeypatch):
    """The current folder, holding the user's files; yields their fingerprint, taken before the case."""
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "empty-dir").mkdir()
    monkeypatch.chdir(tmp_path)
    return _fingerprint(tmp_path)


@pytest.mark.parametrize(("args", "words", "code"), CLI_CASES)
def test_a_mistake_gets_one_line_its_exit_code_and_leaves_every_file_alone(args, words, code, users_folder, tmp_path):
    result = CliRunner().invoke(main, args)
    stderr = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in stderr if line.startswith("memplan: error:")]
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    assert len(errors) == 1 and stderr[-1] == errors[0], result.output  # one line, the last one said
    for word in words:
        assert word in errors[0], errors[0]
    assert _fingerprint(tmp_path) == users_folder  # nothing written, nothing changed


C = {"device": "cpu", "seq_len": 32}
M = "tests.bad_models:mlp"


def api(function, *args, **kwargs):
    return pytest.param(function, args, kwargs, id=f"{function}{args}{kwargs}"[:120])


# (function, positional, keyword): each must raise a MemplanError whose message contains the words.
API_CASES = [
    # the model
    (api("estimate", 123, **C), 2, ["model must be a preset name", "int"]),
    (api("estimate", None, **C), 2, ["model must be", "NoneType"]),
    (api("estimate", nn.Linear(2, 2), **C), 2, ["a model object needs its batch", "inputs=fn(batch_size)"]),
    (api("estimate", b"tiny-gpt2", **C), 2, ["model must be", "bytes"]),
    (api("estimate", Path("not-json.json"), **C), 2, ["cannot read not-json.json as a JSON config"]),
    (api("estimate", "nosuchmodel", **C), 2, ["unknown model 'nosuchmodel'"]),
    (api("estimate", M, inputs=123, device="cpu"), 2, ["inputs must be 'package.module:fn'"]),
    (api("estimate", M, inputs=len, device="cpu"), 2, ["inputs must be 'package.module:fn'", "builtin"]),
    (api("estimate", "tiny-gpt2", loss=5, **C), 2, ["loss must be 'package.module:fn'"]),
    (api("estimate", "tiny-gpt2", task=5, **C), 2, ["task must be one of", "got 5"]),
    (api("estimate", "tiny-gpt2", task="translation", **C), 2, ["task must be one of"]),
    (api("estimate", "tiny-gpt2", progress=5, **C), 2, ["progress must be a function"]),
    # settings of the wrong type or value
    (api("estimate", "tiny-gpt2", batch_size="8", **C), 2, ["batch size must be a positive integer, got '8'"]),
    (api("estimate", "tiny-gpt2", batch_size=2.0, **C), 2, ["batch size must be a positive integer, got 2.0"]),
    (api("estimate", "tiny-gpt2", batch_size=True, **C), 2, ["batch size must be a positive integer, got True"]),
    (api("estimate", "tiny-gpt2", batch_size=None, **C), 2, ["batch size must be a positive integer, got None"]),
    (api("estimate", "tiny-gpt2", grad_accum=1.5, **C), 2, ["gradient accumulation steps"]),
    (api("estimate", "tiny-gpt2", device="cpu", seq_len="32"), 2, ["sequence length must be a positive integer"]),
    (api("estimate", "tiny-gpt2", precision=None, **C), 2, ["precision must be a string"]),
    (api("estimate", "tiny-gpt2", precision="fp8", **C), 2, ["precision must be one of"]),
    (api("estimate", "tiny-gpt2", device=0, seq_len=32), 2, ["device must be a string"]),
    (api("estimate", "tiny-gpt2", gpu=80, seq_len=32), 2, ["gpu must be a string"]),
    (api("estimate", "tiny-gpt2", cuda_context="lots", seq_len=32), 2, ["cannot read 'lots' as a size"]),
    (api("estimate", "tiny-gpt2", cuda_context=1.5, seq_len=32), 2, ["CUDA context", "integer"]),
    (api("estimate", "tiny-gpt2", gpu="T4", cuda_context="20GiB", seq_len=32), 2, ["T4 has 15.00 GiB"]),
    (
        api(
            "estimate", "tiny-gpt2", loss="tests.zoo_models:mean_square_loss", step="tests.custom_steps:two_views", **C
        ),
        2,
        ["leave out loss"],
    ),
    (api("estimate", "tiny-gpt2", cuda_alloc_conf=5, seq_len=32), 2, ["cuda_alloc_conf must be a string"]),
    (api("estimate", "tiny-gpt2", cublas_workspace_config=5, seq_len=32), 2, ["must be a string"]),
    (api("estimate", "tiny-gpt2", cudnn_benchmark="yes", seq_len=32), 2, ["cudnn_benchmark is True or False"]),
    (api("estimate", "tiny-gpt2", checkpoint=5, **C), 2, ["checkpoint must be one of"]),
    (api("estimate", "tiny-gpt2", checkpoint=["transformer.h.0"], **C), 2, ["checkpoint must be one of"]),
    (api("estimate", "tiny-gpt2", checkpoint="missing.json", **C), 2, ["cannot read plan missing.json"]),
    (api("estimate", "tiny-gpt2", {"batch_size": 2}), 2, ["settings must be a memplan.TrainingSettings", "dict"]),
    (api("estimate", "tiny-gpt2", "cpu"), 2, ["settings must be a memplan.TrainingSettings", "str"]),
    (api("estimate", "tiny-gpt2", batch=8, **C), 2, ["unknown setting(s) batch"]),
    (api("estimate", "tiny-gpt2", target_len=8, **C), 2, ["target_len has no place", "drop target_len"]),
    (api("estimate", "tiny-gpt2", budget=[1], **C), 2, ["budget must be a size"]),
    (api("estimate", "tiny-gpt2", budget=True, **C), 2, ["budget must be a size"]),
    (api("estimate", "tiny-gpt2", budget=-1, **C), 2, ["size must be positive"]),
    (api("estimate", "tiny-gpt2", budget=1.5, **C), 2, ["budget must be a whole number of bytes", "1.5"]),
    (api("estimate", "tiny-gpt2", budget="abc", **C), 2, ["cannot read 'abc' as a size"]),
    # sweep, compare, plan
    (api("sweep", "tiny-gpt2", batch_sizes=4, **C), 2, ["batch_sizes takes positive integers"]),
    (api("sweep", "tiny-gpt2", batch_size=4, **C), 2, ["sweep traces batch_sizes", "batch_size is for one"]),
    (api("sweep", "tiny-gpt2", batch_sizes=["1"], **C), 2, ["batch_sizes takes positive integers"]),
    (api("sweep", "tiny-gpt2", batch_sizes="1,x", **C), 2, ["batch_sizes takes integers"]),
    (api("sweep", "tiny-gpt2", batch_sizes=[0], **C), 2, ["positive integers"]),
    (api("sweep", "tiny-gpt2", batch_sizes=(1,), precisions=[5], **C), 2, ["precisions must be names"]),
    (api("sweep", "tiny-gpt2", batch_sizes=(1,), precisions="fp8", **C), 2, ["precisions takes", "fp8"]),
    (api("sweep", "tiny-gpt2", batch_sizes=(1,), checkpoints="sometimes", **C), 2, ["checkpoints takes", "sometimes"]),
    (api("compare", "tiny-gpt2", gpus="2", **C), 2, ["gpus must be a positive integer, got '2'"]),
    (api("compare", "tiny-gpt2", gpus=1.5, **C), 2, ["gpus must be a positive integer, got 1.5"]),
    (api("compare", "tiny-gpt2", gpus=0, **C), 2, ["gpus must be a positive integer, got 0"]),
    (api("compare", "tiny-gpt2", gpus=2, parallel="fsdp", **C), 2, ["give world_size=2 instead of gpus=2"]),
    (api("compare", "tiny-gpt2", gpus=2, parallel="ddp", world_size=4, **C), 2, ["both count data-parallel GPUs"]),
    (api("compare", "tiny-gpt2", budget={}, **C), 2, ["budget must be a size"]),
    (api("plan", "tiny-gpt2", **C), 2, ["needs a budget"]),
    (api("plan", "tiny-gpt2", gpu="T4,L4"), 2, ["gpu='T4,L4' names several cards", "which_gpu from Python"]),
    (api("plan", "tiny-gpt2", budget="1GiB", checkpoint="all", **C), 2, ["chooses the checkpointing itself"]),
    (api("plan", "tiny-gpt2", budget="1GiB", solver="magic", **C), 2, ["solver must be"]),
    (api("plan", "tiny-gpt2", budget="1GiB", jobs=0, **C), 2, ["jobs must be a positive integer, got 0"]),
    (api("plan", "tiny-gpt2", budget="1GiB", jobs="2", **C), 2, ["jobs must be a positive integer"]),
    (api("plan", "tiny-gpt2", budget="1GiB", candidates=5, **C), 2, ["candidates must be a regular expression"]),
    (api("plan", "tiny-gpt2", budget="1GiB", candidates="(", **C), 2, ["not a valid regular expression"]),
    (api("plan", "tiny-gpt2", budget="1GiB", selective="yes", **C), 2, ["selective is True or False"]),
    (api("plan_batch", "tiny-gpt2", budget="1GiB", **C), 2, ["plan_batch ranks by", "device='cuda'"]),
    (api("plan_batch", "tiny-gpt2", budget="1GiB", batch_size=4, seq_len=32), 2, ["plan_batch chooses the batch"]),
    # validate, validate_suite
    (api("validate", "tiny-gpt2", warmup=0, **C), 2, ["warmup must be an integer of at least 1", "got 0"]),
    (api("validate", "tiny-gpt2", warmup=-1, **C), 2, ["warmup must", "got -1"]),
    (api("validate", "tiny-gpt2", warmup="2", **C), 2, ["warmup must", "got '2'"]),
    (api("validate", "tiny-gpt2", timeout_s=-5, **C), 2, ["timeout_s must be a positive number"]),
    (api("validate", "tiny-gpt2", timeout_s="x", **C), 2, ["timeout_s must"]),
    (api("validate", "tiny-gpt2", snapshot="s.pickle", **C), 2, ["snapshot records", "device='cuda'"]),
    (api("validate", "tiny-gpt2", snapshot=5, seq_len=32), 2, ["snapshot must be a file path"]),
    (api("validate", 5, **C), 2, ["model must be"]),
    (api("validate_suite", "nosuch", "r.json", device="cpu"), 2, ["unknown suite 'nosuch'"]),
    (api("validate_suite", "smoke", 5, device="cpu"), 2, ["results must be a file path"]),
    (api("validate_suite", "smoke", "missing-dir/r.json", device="cpu"), 2, ["missing-dir does not exist"]),
    (api("validate_suite", "smoke", "r.json", device="cpu", warmup=0), 2, ["warmup must"]),
    (api("validate_suite", "smoke", "existing.json", device="cpu"), 2, ["resume=True to", "replace=True to"]),
    # apply_plan
    (api("apply_plan", nn.Linear(2, 2), "missing.json"), 2, ["cannot read plan missing.json"]),
    (api("apply_plan", nn.Linear(2, 2), "plan-garbage.json"), 2, ["is not JSON"]),
    (api("apply_plan", nn.Linear(2, 2), 5), 2, ["a plan is a file", "int"]),
    (api("apply_plan", nn.Linear(2, 2), "all"), 2, ["apply_plan takes a plan file", "'all' is a checkpoint mode"]),
    (api("apply_plan", nn.Linear(2, 2), None), 2, ["a plan is a file", "NoneType"]),
    (api("apply_plan", "gpt2", "plan-garbage.json"), 2, ["checkpoints a real torch.nn.Module", "str"]),
]


@pytest.mark.parametrize(
    ("call", "code", "words"),
    [pytest.param(call.values, code, words, id=call.id) for call, code, words in API_CASES],
)
def test_an_api_mistake_raises_memplans_own_one_line_error(call, code, words, users_folder, tmp_path):
    function, args, kwargs = call
    with pytest.raises(MemplanError) as raised:
        result = getattr(memplan, function)(*args, **kwargs)
        if function == "validate_suite":
            next(iter(result))
    message = str(raised.value)
    assert raised.value.exit_code == code, message
    assert "\n" not in message.strip(), message
    for word in words:
        assert word in message, message
    assert _fingerprint(tmp_path) == users_folder


def test_memplan_validate_is_the_function_not_the_subpackage():
    """`memplan.api` imports memplan.validate.*, which binds the subpackage to `memplan.validate`."""
    import memplan.api
    import memplan.validate.runner  # noqa: F401  (the subpackage, loaded)

    assert memplan.validate is memplan.api.validate


def test_every_api_function_has_cases():
    named = {call.values[0] for call, _, _ in API_CASES}
    assert {"estimate", "sweep", "compare", "plan", "validate", "validate_suite", "apply_plan"} <= named


def test_a_name_like_no_model_gets_no_suggestion():
    """'nosuchmodel' was asked "did you mean neucodec?" (difflib's 0.6 cutoff); near misses still get theirs."""
    result = CliRunner().invoke(main, ["estimate", "nosuchmodel"])
    assert result.exit_code == 2 and "did you mean" not in result.output
    assert "did you mean llama-2-7b" in CliRunner().invoke(main, ["estimate", "llama2-7b"]).output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Path("") is ".", a folder: "cannot read plan : Is a directory" had said nothing of the empty value
        (["estimate", "tiny-gpt2", "--device", "cpu", "--checkpoint", ""], "--checkpoint is empty: give one of none"),
        # it fell back to validation-smoke.json where every other output option refuses an empty name
        (["validate", "--suite", "smoke", "--device", "cpu", "--results", ""], "--results is empty; give it a file"),
        # the suggestion had been the very string it refused
        (
            ["estimate", "tests.bad_models:mlp:x", "--device", "cpu", "--inputs", "tests.bad_models:inputs"],
            "did you mean tests.bad_models.mlp:x?",
        ),
    ],
)
def test_empty_values_and_a_path_with_two_colons_are_told_how_to_fix_them(args, message):
    """CLI bug hunt: each message says what is wrong and how to fix it, in one line, status 2."""
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2 and message in done.output and done.output.count("\n") == 1, done.output
