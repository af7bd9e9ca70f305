"""Answers kept on disk: a repeated `estimate`, `sweep` or `compare` prints what the same command
printed before, without importing torch or tracing anything (issue 20).

An answer is keyed by everything that decides it:
- the command and the value of every option, defaults included;
- the model's own files: a local config.json (or a model folder's), an --hf-args file, a plan file
  given as --checkpoint; a preset's JSON is part of memplan's source;
- memplan's source (every .py and .json file of the package), and the installed torch,
  transformers, peft and bitsandbytes;
- the environment variables that configure the CUDA libraries, the allocator or memplan;
- how the output is shown: a terminal or a pipe, its width, colour.

Only commands that run no code of the user's and write no file are kept: a `package.module:fn`
model, --inputs, --loss, --step, --plot and --snapshot are traced every time, as is a hub id (its
files live in another cache). Only answers that succeeded are kept, at most CAP_BYTES of them, the
least recently used going first. `--no-cache` or MEMPLAN_NO_CACHE=1 traces anyway; MEMPLAN_CACHE_DIR
moves the cache (default: $XDG_CACHE_HOME/memplan, else ~/.cache/memplan).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

CACHE_DIR_VARIABLE = "MEMPLAN_CACHE_DIR"
NO_CACHE_VARIABLE = "MEMPLAN_NO_CACHE"
CAP_BYTES = 64 << 20
# Options whose value names code of the user's (run on every trace) or a file the command writes.
_UNCACHED_OPTIONS = ("inputs", "loss", "step", "plot", "snapshot")
# Options whose value may be a file that decides the answer.
_FILE_OPTIONS = ("hf_args", "checkpoint")
# Environment variables that change an answer (memplan reads the CUDA libraries' own switches, the
# allocator's configuration and its own settings from them) or how it is shown.
_ENVIRONMENT_PREFIXES = ("PYTORCH_", "CUBLAS_", "CUDNN_", "TORCH_", "MEMPLAN_", "NCCL_")
_DISPLAY_VARIABLES = ("COLUMNS", "LINES", "TERM", "NO_COLOR", "FORCE_COLOR", "COLORTERM")
# The CPU kernels' intra-op threads (torch's default: the machine's cores) size per-thread scratch that the cpu
# target counts (memplan.estimator.composite_kernels.flash_attention).
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "click", "rich")
_MEMPLAN_DIR = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR_VARIABLE):
        return Path(os.environ[CACHE_DIR_VARIABLE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memplan"


def _memplan_source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(_MEMPLAN_DIR.rglob("*")):
        if path.suffix in (".py", ".json"):
            digest.update(str(path.relative_to(_MEMPLAN_DIR)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _file_digest(value: str) -> str | None:
    """The digest of the file a value names (a folder: its config.json), or None if it names none."""
    path = Path(value)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _model_digest(model: str) -> str | None:
    """What the model's answer depends on beyond memplan: its config file's content; "preset" for a
    name memplan ships (part of its source); None where it runs code (`package.module:fn`) or lives
    elsewhere (a hub id): neither is kept."""
    digest = _file_digest(model)
    if digest is not None:
        return digest
    from memplan.models.presets import get_preset

    return "preset" if get_preset(model) is not None else None


def _stream_is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# An answer's file: memplan's prefix and the key's 64 hex digits. The folder may hold files of the user's own
# (MEMPLAN_CACHE_DIR is theirs to point anywhere): only files so named are ever read as answers or deleted.
ANSWER_PREFIX = "memplan-answer-"
_ANSWER_NAME = re.compile(rf"{ANSWER_PREFIX}[0-9a-f]{{64}}\.json")


class CachedAnswer:
    """Where a command's answer is kept, and the output it printed."""

    def __init__(self, key: str) -> None:
        self.path = cache_dir() / f"{ANSWER_PREFIX}{key}.json"

    def replay(self) -> bool:
        """Print the kept output, if there is one; whether there was."""
        try:
            output = json.loads(self.path.read_text())["stdout"]
        except (OSError, ValueError, KeyError, TypeError):
            return False  # none, or unreadable: trace
        if not isinstance(output, str):
            return False  # damaged ({"stdout": 5}): trace, and keep the new answer in its place
        try:
            sys.stdout.write(output)
            sys.stdout.flush()
        except BrokenPipeError:  # a reader that stopped reading (`| head -1`): as rich's console ends then
            raise SystemExit(1) from None
        with contextlib.suppress(OSError):
            self.path.touch()  # recently used
        from memplan.cli.options import _quiet

        if not _quiet():
            print(f"memplan: answered from the cache in {self.path.parent} (--no-cache traces again)", file=sys.stderr)
        return True

    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        """Run the command, printing as ever, and keep what it printed if it succeeds."""
        real = sys.stdout
        tee = _Tee(real)
        sys.stdout = tee  # type: ignore[assignment]
        try:
            yield
        finally:
            sys.stdout = real
        self._keep(tee.captured.getvalue())

    def _keep(self, output: str) -> None:
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".part")
            partial.write_text(json.dumps({"stdout": output}))
            partial.replace(self.path)  # whole or not at all
            _evict(folder, CAP_BYTES)
        except OSError:
            pass  # a cache that cannot be written is no cache: the answer was printed


def _evict(folder: Path, cap_bytes: int) -> None:
    """Delete the least recently used answers until the folder's answers take at most `cap_bytes`; nothing else
    in the folder is counted or touched."""
    entries = [
        (path.stat().st_mtime, path.stat().st_size, path)
        for path in folder.glob(f"{ANSWER_PREFIX}*.json")
        if _ANSWER_NAME.fullmatch(path.name)
    ]
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda entry: entry[0]):
        if total <= cap_bytes:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            total -= size


class _Tee(io.TextIOBase):
    """Writes through to the real stream and keeps a copy; asks the real stream everything else."""

    def __init__(self, real: TextIO) -> None:
        super().__init__()
        self.real = real
        self.captured = io.StringIO()

    def write(self, text: str) -> int:
        self.captured.write(text)
        return self.real.write(text)

    def flush(self) -> None:
        self.real.flush()

    def isatty(self) -> bool:
        return _stream_is_terminal(self.real)

    def fileno(self) -> int:
        return self.real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.real, "encoding", "utf-8")


def cached_answer(command: str, params: dict[str, Any], typed: set[str] | None = None) -> CachedAnswer | None:
    """Where `command` with these parsed options keeps its answer; None when it is not to be kept. `typed`: the
    options given on the command line or by their environment variables, which with --hf-args decide whether
    the file's value or the option's is taken, so they are part of the key there."""
    if params.get("no_cache") or os.environ.get(NO_CACHE_VARIABLE) == "1":
        return None
    if any(params.get(name) is not None for name in _UNCACHED_OPTIONS):
        return None
    model = params.get("model")
    model_digest = _model_digest(model) if isinstance(model, str) else None
    if model_digest is None:
        return None
    files = {name: _file_digest(value) for name in _FILE_OPTIONS if isinstance(value := params.get(name), str)}
    if isinstance(params.get("hf_args"), str):  # the DeepSpeed file it names decides the answer as well
        from memplan.hf_args import deepspeed_file_of

        named = deepspeed_file_of(params["hf_args"])
        files["hf_args_deepspeed"] = _file_digest(str(named)) if named is not None else None
    environment = {
        name: value
        for name, value in os.environ.items()
        if name.startswith(_ENVIRONMENT_PREFIXES) or name in _DISPLAY_VARIABLES + _THREAD_VARIABLES
    }
    environment.pop(NO_CACHE_VARIABLE, None)
    key_parts = {
        "command": command,
        "options": {name: value for name, value in params.items() if name != "no_cache"},
        "typed": sorted(typed or ()) if isinstance(params.get("hf_args"), str) else None,
        "model": model_digest,
        "files": files,
        "memplan": _memplan_source_digest(),
        "packages": {package: _version(package) for package in _PACKAGES},
        "python": sys.version,
        "environment": environment,
        # the cores this process may run on (taskset, a container's cpuset), which torch's threads follow
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "terminal": _stream_is_terminal(sys.stdout),  # the answer is stdout; stderr is not kept
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()
    return CachedAnswer(key)
