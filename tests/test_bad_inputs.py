"""User mistakes: each answered in one line, with the usage exit code, and nothing the user gave touched.

Every case runs the real CLI in a folder of the user's files, and checks: exit code 2, a single
"memplan: error: ..." or click "Error: ..." line naming what is wrong, no traceback, no "internal
error", and every file in the folder byte-for-byte what it was (nothing written, nothing lost).
"""

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli import main

CONFIGS = {
    "empty.json": "{}",
    "not-json.json": "garbage",
    "unknown-type.json": json.dumps({"model_type": "no-such-architecture"}),
    "heads-do-not-divide.json": json.dumps({"model_type": "gpt2", "n_head": 5, "n_embd": 64, "n_layer": 1}),
    "list.json": "[1, 2]",
    "training-args-typo.json": json.dumps({"per_device_train_batch_size": 4, "gradient_acumulation_steps": 2}),
}

# (arguments, words the one line must contain)
CASES = [
    (["estimate", "empty.json"], ["no model_type"]),
    (["estimate", "not-json.json"], ["cannot read", "JSON"]),
    (["estimate", "list.json"], ["no model_type"]),
    (["estimate", "unknown-type.json"], ["transformers cannot load", "no-such-architecture"]),
    (["estimate", "heads-do-not-divide.json", "-b", "1", "--seq-len", "8"], ["cannot build", "fix the config"]),
    (["estimate", "empty-dir"], ["no config.json"]),
    (["estimate", "openai-community/gpt2"], ["preset gpt2"]),
    (["estimate", "mistralai/Mistral-7B-v0.1"], ["preset mistral-7b"]),
    (["estimate", "someorg/gpt2-mediun"], ["did you mean gpt2-medium"]),
    (["estimate", "gpt2", "--gpu", "A100-80GB", "--device", "cpu"], ["--gpu", "--device cpu", "--budget"]),
    (["plan", "gpt2", "--gpu", "A100-80GB", "--device", "cpu", "--budget", "1GiB"], ["--gpu", "--device cpu"]),
    (["validate", "gpt2", "--suite", "main"], ["--suite main", "drop MODEL"]),
    (["validate", "gpt2", "--warmup", "0", "--device", "cpu"], ["--warmup"]),
    (["validate", "gpt2", "--warmup", "-1", "--device", "cpu"], ["--warmup"]),
    (["validate", "gpt2", "--timeout", "-5", "--device", "cpu"], ["--timeout"]),
    (["validate", "gpt2", "--timeout", "0", "--device", "cpu"], ["--timeout"]),
    (["estimate", "gpt2", "--hf-args", "training-args-typo.json"], ["did you mean 'gradient_accumulation_steps'"]),
    (["estimate", "gpt2", "-b", "100000000000000000000"], ["batch size", "at most 1,048,576"]),
    (["estimate", "gpt2", "--grad-accum", "2000000"], ["gradient accumulation", "at most"]),
    (["estimate", "gpt2", "--inputs", "tests.zoo_models:features_inputs"], ["--inputs", "drop --inputs"]),
    (
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
]


def _fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        for path in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize(("args", "words"), CASES, ids=[" ".join(args) for args, _ in CASES])
def test_a_mistake_gets_one_line_exit_2_and_leaves_every_file_alone(args, words, tmp_path, monkeypatch):
    for name, text in CONFIGS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "empty-dir").mkdir()
    before = _fingerprint(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    message = lines[-1] if lines else ""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert message.startswith(("memplan: error:", "Error:")), result.output
    assert len([line for line in lines if line.startswith(("memplan: error:", "Error:"))]) == 1
    for word in words:
        assert word in message, message
    assert _fingerprint(tmp_path) == before  # nothing written, nothing changed
