"""Files memplan writes: never half-written, never over an input, never over a file unasked.

`write_atomically` writes beside the target and renames over it (os.replace is atomic on one file
system), so a crash or Ctrl-C leaves either the old file or the whole new one. `check_output`
runs before any work: the folder must exist, the file must not be one of the command's inputs
(a --hf-args, DeepSpeed or plan file, the model's config.json, the source file of a
`module:function` the command imports), it must be a regular file where it exists (never a device such as
/dev/null, a pipe or a folder), and an existing file is refused unless the user said --force. A link's file is
replaced, the link kept.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from memplan.errors import OutputError, UsageError

_SOURCE_SUFFIXES = frozenset({".py", ".pyi", ".pyx", ".pyc", ".ipynb"})


def check_output(option: str, path: str | Path, *, inputs: Iterable[str | Path] = (), force: bool = False) -> None:
    """`inputs`: the files the command reads, which no output may replace."""
    if not str(path).strip():
        raise UsageError(f"--{option} is empty; give it a file name")
    if str(path).strip() == "-":  # read as "standard output" by many tools: memplan would have made a file named -
        raise UsageError(f"--{option} - : memplan writes this to a file, not to standard output; give it a file name")
    target = Path(path)
    folder = target.resolve().parent
    if not folder.is_dir():  # a link's own folder exists; the one it points into is named
        shown = folder if target.is_symlink() else target.parent
        raise UsageError(f"--{option} {path}: the folder {shown} does not exist; create it first")
    for given in inputs:
        if Path(given).exists() and target.exists() and os.path.samefile(given, target):
            raise UsageError(f"--{option} {path} is also an input of this command; name another file")
    if target.resolve().suffix in _SOURCE_SUFFIXES and target.exists():
        # memplan writes JSON, pictures and snapshots, never code: an existing source file is someone's program
        # (a package's __init__.py, the module an --inputs function is re-exported from), --force or not
        raise UsageError(f"--{option} {path} is a Python source file; memplan never replaces one, name another file")
    if target.exists() and not target.is_file():
        # a folder, a device (/dev/null), a pipe or a socket: renaming a file over it (--force) would put a plain
        # file in its place, and for /dev/null as root that breaks the machine
        raise UsageError(f"--{option} {path} is not a regular file (a folder, device or pipe); name a file to write")
    if target.exists() and not force:
        raise UsageError(f"--{option} {path} exists; pass --force to replace it, or name another file")


def _mode_for(target: Path) -> int:
    """The permission bits a written `target` gets: those of the file there now, else 0666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0)  # read by setting it; put back at once
        os.umask(umask)
        return 0o666 & ~umask


def write_atomically(path: str | Path, write: Callable[[IO[bytes]], None], what: str) -> None:
    """`write(file)` into a temporary file beside `path`, then rename it over `path` (over the file a link there
    points to: the user's link stays)."""
    target = Path(path)
    if target.is_symlink():
        target = target.resolve()
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.resolve().parent)
    except OSError as error:
        raise OutputError(f"cannot write the {what} to {path}: {error.strerror or error}") from error
    try:
        # mkstemp makes the file 0600: give it the mode a plain open() would (0666 less the umask), or the mode
        # of the file it replaces.
        os.chmod(temporary, _mode_for(target))
        with os.fdopen(descriptor, "wb") as file:
            write(file)
        os.replace(temporary, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise OutputError(f"cannot write the {what} to {path}: {error.strerror or error}") from error
        raise
