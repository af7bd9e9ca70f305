"""memplan.cli.run, the `memplan` process's entry point: it leaves with os._exit once main() is done, so what a
normal exit does before the teardown it skips must still happen, each checked in a real child process; and
memplan.cli.running._run imports torch with Python's collector off (memplan.cli.collector), and gives it
back for the command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# stdout block-buffered as a pipe is by default (PYTHONUNBUFFERED, set on some machines, would hide a missing flush)
ENVIRONMENT = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"} | {"PYTHONPATH": str(ROOT)}


def _child(body: str) -> subprocess.CompletedProcess[str]:
    """A Python process that runs `body` and then memplan.cli.run() with argv ['memplan', '--version']."""
    program = f"import sys\nimport memplan.cli\n{body}\nsys.argv = ['memplan', '--version']\nmemplan.cli.run()\n"
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=ENVIRONMENT, timeout=120, check=False
    )


def test_buffered_output_and_atexit_functions_survive_the_quick_exit() -> None:
    # stdout is a pipe here, so block-buffered: without a flush before os._exit the version line is lost
    done = _child("import atexit\natexit.register(lambda: print('atexit function ran', flush=True))")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "memplan, version " + _version() + "\natexit function ran\n"


def test_a_running_thread_is_waited_for_as_at_a_normal_exit() -> None:
    body = "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()"
    done = _child(body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["memplan, version " + _version(), "thread done"]


def test_the_exit_status_is_python_s_own() -> None:
    stop_with = "import memplan.cli as cli\ncli.main = lambda: sys.exit({})"
    assert _child(stop_with.format(3)).returncode == 3
    assert _child(stop_with.format(None)).returncode == 0
    text = _child(stop_with.format("'a message'"))
    assert (text.returncode, text.stderr) == (1, "a message\n")


def test_a_usage_error_is_one_line_and_status_2_through_python_minus_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "memplan", "estimate", "gpt2", "-b", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "memplan: error: batch size must be a positive integer, got 0\n"


def test_output_that_cannot_be_flushed_is_status_120_as_at_python_s_own_exit() -> None:
    # the reader is gone before the buffered line is flushed (`memplan ... | head -0`): CPython's own exit is 120
    reader, writer = os.pipe()
    os.close(reader)
    program = "import sys\nimport memplan.cli\nmemplan.cli.main = lambda: (print('buffered'), sys.exit(0))\n"
    done = subprocess.run(
        [sys.executable, "-c", program + "memplan.cli.run()\n"],
        stdout=writer,
        stderr=subprocess.PIPE,
        env=ENVIRONMENT,
        timeout=120,
        check=False,
    )
    os.close(writer)
    assert done.returncode == 120
    assert b"BrokenPipeError" not in done.stderr  # raised by the flush at exit, not by print()


def _version() -> str:
    from memplan.version import __version__

    return __version__


def _memplan(args: list[str], environment: dict[str, str] = ENVIRONMENT, **streams: object) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args], env=environment, cwd=ROOT, timeout=300, check=False, **streams
    )


def _stdout_closed(args: str) -> str:
    """What `memplan <args> >&-` says on stderr, then its exit status."""
    command = f'"{sys.executable}" -m memplan {args} >&-; echo "status $?" >&2'
    done = subprocess.run(
        ["sh", "-c", command], env=ENVIRONMENT, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    return done.stderr


def test_a_closed_standard_output_is_no_traceback_and_keeps_the_usage_error_s_status() -> None:
    """`memplan ... >&-`: Python makes sys.stdout None; the flush at exit failed on it, a traceback and status 1
    for `--version`, and status 1 for a usage error that had said itself in one line."""
    assert _stdout_closed("--version") == "status 0\n"
    refused = _stdout_closed("estimate gpt2 -b 0")
    assert refused == "memplan: error: batch size must be a positive integer, got 0\nstatus 2\n"


def test_an_answer_that_cannot_be_written_is_one_line_and_status_1(tmp_path: Path, monkeypatch) -> None:
    """`memplan estimate ... > /dev/full` (a full disk): a 30-line traceback from the cache's replay, and an
    internal error from the traced answer. The suite turns the cache off (conftest); these children have one."""
    from click.testing import CliRunner

    from memplan.cli import main

    cached = {key: value for key, value in ENVIRONMENT.items() if key != "MEMPLAN_NO_CACHE"}
    cached["MEMPLAN_CACHE_DIR"] = str(tmp_path)
    args = ["estimate", "tiny-gpt2", "-b", "2", "--seq-len", "16", "--device", "cpu", "-q"]  # a preset: cached
    monkeypatch.delenv("MEMPLAN_NO_CACHE")
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    assert CliRunner().invoke(main, args).exit_code == 0  # answered, and kept (here: a child would take 2 s more)
    assert list(tmp_path.iterdir())
    with open("/dev/full", "w") as full:
        for extra in ([], ["--no-cache"]):  # answered from the cache, then traced
            done = _memplan([*args, *extra], cached, stdout=full, stderr=subprocess.PIPE)
            assert done.returncode == 1
            assert done.stderr == b"memplan: error: cannot write the answer: No space left on device\n"


@pytest.mark.parametrize("args", [["presets"], ["--version"], ["estimate", "--help"]])
def test_what_prints_outside_a_command_says_a_full_disk_in_one_line_too(args: list[str]) -> None:
    """--help, --version and presets print outside a command's error handling: a traceback each (a bug hunt)."""
    with open("/dev/full", "w") as full:
        done = _memplan(args, ENVIRONMENT, stdout=full, stderr=subprocess.PIPE)
    assert done.returncode == 1
    assert done.stderr == b"memplan: error: cannot write the answer: No space left on device\n"


def test_torch_is_imported_with_the_collector_off_and_the_command_runs_with_it_on(monkeypatch) -> None:
    import gc

    import memplan.cli.running as running

    seen: dict[str, bool] = {}
    monkeypatch.setattr(running, "require_supported_torch", lambda: seen.setdefault("importing", gc.isenabled()))
    assert gc.isenabled()
    running._run(False, lambda: seen.setdefault("command", gc.isenabled()))
    assert seen == {"importing": False, "command": True}
    assert gc.isenabled()
    gc.disable()  # a process that keeps the collector off itself: _run leaves it off
    try:
        running._run(False, lambda: seen.update(command=gc.isenabled()))
        assert seen["command"] is False
    finally:
        gc.enable()


def test_a_batch_the_model_cannot_take_is_one_line_with_no_log_of_torch_s() -> None:
    """torch logs a failing fake kernel with its traceback before raising (fake_tensor.py `log.exception`): 19 lines
    of it came before memplan's one-line error (CLI bug hunt)."""
    done = _memplan(
        ["estimate", "tests.bad_models:mlp", "--inputs", "tests.bad_models:wrong_shape_inputs", "--device", "cpu"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("memplan: error: cannot trace"), done.stderr
