"""Nothing a user gave is lost: outputs refuse existing files unless --force, never replace an
input, and are written whole or not at all."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import OutputError
from memplan.outputs import write_atomically


def run(*args):
    return CliRunner().invoke(main, list(args))


ESTIMATE = ("estimate", "tiny-gpt2", "-b", "2", "--seq-len", "32", "-q")


def test_an_existing_plot_is_kept_unless_force(tmp_path):
    plot = tmp_path / "memory.png"
    plot.write_bytes(b"the user's own picture")
    refused = run(*ESTIMATE, "--plot", str(plot))
    assert refused.exit_code == 2
    assert refused.output.count("\n") == 1 and "exists; pass --force" in refused.output
    assert plot.read_bytes() == b"the user's own picture"
    replaced = run(*ESTIMATE, "--plot", str(plot), "--force")
    assert replaced.exit_code == 0, replaced.output
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_an_input_is_never_an_output_even_with_force(tmp_path):
    args_file = tmp_path / "args.json"
    original = json.dumps({"per_device_train_batch_size": 2})
    args_file.write_text(original)
    result = run("plan", "tiny-gpt2", "--seq-len", "32", "--budget", "1GiB", "--hf-args", str(args_file),
                 "-o", str(args_file), "--force", "-q")  # fmt: skip
    assert result.exit_code == 2 and "is also an input" in result.output
    assert args_file.read_text() == original


def test_a_missing_results_folder_is_refused_before_any_measurement(tmp_path):
    result = run("validate", "--suite", "smoke", "--device", "cpu", "--results", str(tmp_path / "no" / "r.json"))
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not (tmp_path / "no").exists()


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old, complete")

    def write_half_then_fail(file):
        file.write(b"new, but only ha")
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, write_half_then_fail, "plan")
    assert target.read_text() == "old, complete"
    assert [path.name for path in Path(tmp_path).iterdir()] == ["plan.json"]  # no temporary left behind


def test_an_unwritable_place_is_one_clear_error(tmp_path):
    with pytest.raises(OutputError, match="cannot write the plan to"):
        write_atomically(tmp_path / "missing" / "plan.json", lambda file: file.write(b"x"), "plan")
