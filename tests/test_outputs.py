"""Nothing a user gave is lost: outputs refuse existing files unless --force, never replace an
input, and are written whole or not at all."""

import json
import os
import stat
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


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}))
    return folder


@pytest.mark.parametrize("given_as", ["config file", "folder"])
def test_the_model_s_own_files_are_never_an_output(tmp_path, given_as):
    folder = _model_folder(tmp_path)
    config = folder / "config.json"
    original = config.read_text()
    model = str(config if given_as == "config file" else folder)
    result = run("plan", model, "--seq-len", "32", "--budget", "1GiB", "-o", str(config), "--force", "-q")
    assert result.exit_code == 2 and "is also an input of this command" in result.output, result.output
    assert config.read_text() == original


def test_a_file_of_its_own_in_the_model_s_folder_is_replaced_with_force(tmp_path):
    """memplan reads only config.json from a model's folder: its own earlier output there is the user's to
    replace."""
    folder = _model_folder(tmp_path)
    earlier = folder / "plan.json"
    earlier.write_text("an earlier plan")
    result = run("plan", str(folder), "--seq-len", "32", "--budget", "1GiB", "-o", str(earlier), "--force", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(earlier.read_text())["settings"]["seq_len"] == 32


def test_the_source_of_an_imported_function_is_never_an_output(tmp_path, monkeypatch):
    package = tmp_path / "mine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("def step(model, batch, optimizer):\n    pass\n")
    source = (package / "train.py").read_text()
    monkeypatch.chdir(tmp_path)  # found from the working directory, as memplan imports it
    result = run("estimate", "tests.two_layer_mlp:two_layer", "--inputs", "tests.two_layer_mlp:rows",
                 "--step", "mine.train:step", "-b", "4", "--plot", "mine/train.py", "--force", "-q")  # fmt: skip
    assert result.exit_code == 2 and "is also an input" in result.output, result.output
    assert (package / "train.py").read_text() == source


@pytest.mark.parametrize("output", ["mine/__init__.py", "mine/helpers.py"])
def test_no_python_source_is_ever_an_output_even_with_force(tmp_path, monkeypatch, output):
    """The package's __init__.py, and the module an --inputs function is really defined in (re-exported by the one
    named): neither is the named module's file, and --force had replaced both with a plan (a bug hunt)."""
    package = tmp_path / "mine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text(
        "import torch\n\ndef rows(batch_size):\n    return torch.randn(batch_size, 16)\n"
    )
    (package / "batches.py").write_text("from mine.helpers import rows  # noqa: F401\n")
    before = {path.name: path.read_text() for path in package.iterdir()}
    monkeypatch.chdir(tmp_path)
    result = run("plan", "tests.two_layer_mlp:two_layer", "--inputs", "mine.batches:rows", "-b", "4",
                 "--budget", "1GiB", "-o", output, "--force", "-q")  # fmt: skip
    assert result.exit_code == 2 and "is a Python source file" in result.output, result.output
    assert {path.name: path.read_text() for path in package.iterdir() if path.suffix == ".py"} == before


def test_the_deepspeed_file_hf_args_names_is_never_an_output(tmp_path):
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"per_device_train_batch_size": 2, "deepspeed": str(deepspeed)}))
    result = run("plan", "tiny-gpt2", "--seq-len", "32", "--budget", "1GiB", "--hf-args", str(args_file),
                 "--world-size", "2", "-o", str(deepspeed), "--force", "-q")  # fmt: skip
    assert result.exit_code == 2 and "is also an input" in result.output, result.output
    assert json.loads(deepspeed.read_text()) == {"zero_optimization": {"stage": 2}}


def test_two_outputs_of_one_command_never_name_one_file(tmp_path):
    picture = tmp_path / "memory.png"
    result = run(*ESTIMATE, "--plot", str(picture), "--snapshot", str(picture))
    assert result.exit_code == 2 and "--plot and --snapshot both name" in result.output, result.output
    assert not picture.exists()


def test_a_dash_for_standard_output_is_refused_not_made_a_file(tmp_path, monkeypatch):
    """`-o -` had written a file named '-' in the working directory (a bug hunt)."""
    monkeypatch.chdir(tmp_path)
    result = run("plan", "tiny-gpt2", "--seq-len", "32", "--budget", "1GiB", "-o", "-", "-q")
    assert result.exit_code == 2 and "not to standard output" in result.output
    assert not (tmp_path / "-").exists()


def test_an_empty_output_name_is_one_line():
    result = run("plan", "tiny-gpt2", "--seq-len", "32", "--budget", "1GiB", "-o", "", "-q")
    assert result.exit_code == 2 and "--output is empty" in result.output


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


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_a_written_file_has_the_mode_open_would_give_it(tmp_path, umask, mode):
    """Every output was 0600 (tempfile.mkstemp's), whatever the umask; a replaced file keeps its own mode."""

    previous = os.umask(umask)
    try:
        write_atomically(tmp_path / "new.json", lambda file: file.write(b"{}"), "test output")
        replaced = tmp_path / "old.json"
        replaced.write_bytes(b"[]")
        replaced.chmod(0o604)
        write_atomically(replaced, lambda file: file.write(b"{}"), "test output")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == mode
    assert stat.S_IMODE(replaced.stat().st_mode) == 0o604 and replaced.read_bytes() == b"{}"


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_what_is_not_a_regular_file_is_never_replaced_even_with_force(tmp_path, kind):
    """`-o /dev/null --force` renamed a plain file over the device (as root, the machine's /dev/null); a pipe or a
    folder the same. (A device is not made here: were the check to go, the test would replace it.)"""
    target = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    before = os.stat(target)
    result = run("plan", "tiny-gpt2", "-b", "2", "--seq-len", "32", "--budget", "1GiB", "-o", str(target), "--force")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "is not a regular file" in result.output or (kind == "folder" and "is a directory" in result.output)
    after = os.stat(target)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino


def test_force_through_a_link_replaces_the_file_it_points_to_and_keeps_the_link(tmp_path):
    real = tmp_path / "plans" / "plan.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    write_atomically(link, lambda file: file.write(b"new"), "plan")
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert real.read_text() == "new"
