"""Import `package.module:attribute` paths given on the command line."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from memplan.errors import ImportPathError, a_type


def is_import_path(text: str) -> bool:
    """`pkg.mod:name` with a dotted module and an identifier, not a Windows drive or a URL."""
    module, sep, attr = text.partition(":")
    return bool(sep) and bool(module) and attr.isidentifier() and all(part.isidentifier() for part in module.split("."))


def import_object(path: str, what: str) -> Any:
    """Import `path`; the current directory is searched first, as `python -m` would."""
    if not is_import_path(path):
        raise ImportPathError(f"{what} {path!r} is not of the form package.module:name")
    module_name, _, attr = path.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module may raise anything while importing
        missing = error.name or "" if isinstance(error, ModuleNotFoundError) else None
        if missing is not None and missing.split(".")[0] == module_name.split(".")[0]:
            fix = "check the name and PYTHONPATH"  # the module itself was not found, not one it imports
        elif missing is not None:
            fix = f"it imports {missing!r}, which is not installed here"
        elif isinstance(error, SyntaxError):
            fix = f"fix {error.filename or 'its file'} at line {error.lineno}"
        else:
            fix = "the module raised this as it was imported: fix it there"
        raise ImportPathError(
            f"cannot import module {module_name!r} for {what} {path!r} ({type(error).__name__}: {error}); {fix}"
        ) from error
    try:
        obj = getattr(module, attr)
    except AttributeError as error:
        raise ImportPathError(f"module {module_name!r} has no attribute {attr!r} ({what} {path!r})") from error
    if not callable(obj):
        raise ImportPathError(f"{what} {path!r} is {a_type(obj)}, not a callable")
    return obj
