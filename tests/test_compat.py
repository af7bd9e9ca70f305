"""The supported torch range: refused in one line outside it, and memplan runs from a bare source tree."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from memplan.cli import main
from memplan.compat import ALLOW_ENVIRONMENT_VARIABLE, check_torch_version, torch_release
from memplan.errors import UnsupportedTorchError

REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.11.0+cu130", (2, 11)), ("2.13.0+cpu", (2, 13)), ("2.14.0a0+git1234", (2, 14)), ("3.0.1", (3, 0))],
)
def test_release_is_read_from_any_build_string(version, release):
    assert torch_release(version) == release


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cu128", "2.13.0+cpu", "2.14.1"])
def test_tested_releases_are_accepted(version):
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "1.13.1", "2.15.0", "3.0.0"])
def test_other_releases_are_refused(version):
    with pytest.raises(UnsupportedTorchError, match="tested on torch 2.11 to 2.14"):
        check_torch_version(version)


def test_an_unreadable_version_is_refused():
    with pytest.raises(UnsupportedTorchError, match="cannot read the torch version 'nightly'"):
        check_torch_version("nightly")


def test_the_installed_torch_is_supported():
    # The suite runs only on supported releases; a CI leg on another one must fail here first.
    check_torch_version(torch.__version__)


def test_cli_refuses_an_unsupported_torch_in_one_line(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    monkeypatch.delenv(ALLOW_ENVIRONMENT_VARIABLE, raising=False)
    result = CliRunner().invoke(main, ["estimate", "gpt2"])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1
    assert result.output.startswith("memplan: error: torch 2.10.0 is not supported")
    monkeypatch.setenv(ALLOW_ENVIRONMENT_VARIABLE, "1")
    result = CliRunner().invoke(main, ["estimate", "nonexistent-model-name"])
    assert "is not supported" not in result.output


def _source_tree_run(*args: str) -> subprocess.CompletedProcess:
    """`python -m memplan ...` as on a machine with no network: from the checkout, nothing installed."""
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args], cwd=REPOSITORY, env=environment, capture_output=True, text=True
    )


def test_version_from_the_source_tree_reads_no_package_metadata():
    from memplan.version import __version__

    result = _source_tree_run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"memplan, version {__version__}\n"


def test_a_command_from_the_source_tree():
    result = _source_tree_run("presets")
    assert result.returncode == 0, result.stderr
    assert "llama-3-8b" in result.stdout
