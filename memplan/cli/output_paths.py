"""The files a command writes, checked before its work: never one of the files it reads, never two
outputs in one file, never an existing file without --force (memplan.outputs)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from memplan.errors import UsageError


def check_output_paths(**paths: str | None) -> None:
    """Before the work, not after it: refuse an output whose folder does not exist, that is one of
    the command's own input files, that another output of the command names too, or that exists when
    --force was not given (memplan.outputs)."""
    from memplan.outputs import check_output

    context = click.get_current_context()
    force = bool(context.find_root().meta.get("memplan.force"))
    files = _input_paths(context)
    named: dict[Path, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        check_output(option, path, inputs=files, force=force)
        target = Path(path).resolve()
        if target in named:
            raise UsageError(f"--{named[target]} and --{option} both name {path}; give each its own file")
        named[target] = option
    if paths.get("plot") is not None:
        from memplan.render.plot import check_plot_path

        check_plot_path(paths["plot"])


def _input_paths(context: click.Context) -> list[str]:
    """The files the command reads, which no output may replace: --hf-args and the DeepSpeed file it names,
    --deepspeed, a --checkpoint plan, the model's config.json (given as the file or its folder), and the source
    file of each `module:function` it imports (the model, --inputs, --loss, --step)."""
    from memplan.hf_args import deepspeed_file_of
    from memplan.models.imports import is_import_path

    params = context.params
    files = [params.get(name) for name in ("hf_args", "checkpoint")]
    files.append(context.meta.get("memplan.deepspeed_path"))
    if isinstance(params.get("hf_args"), str):
        files.append(str(deepspeed_file_of(params["hf_args"]) or ""))
    for name in ("model", "inputs", "loss", "step"):
        value = params.get(name)
        if not isinstance(value, str) or not value:
            continue
        if is_import_path(value):
            files.append(str(_module_file(value.partition(":")[0]) or ""))
        elif Path(value).is_dir():
            files.append(str(Path(value) / "config.json"))  # the one file memplan reads from a model's folder
        else:
            files.append(value)
    return [given for given in files if isinstance(given, str) and given]


def _module_file(module: str) -> Path | None:
    """Where `module` (dotted) would be imported from, found without running it: the working directory first, as
    memplan.models.imports puts it, then where Python's finders place its top-level package (an editable
    install's too; finding a top-level package runs none of its code)."""
    import importlib.util

    top, *rest = module.split(".")
    roots = [Path(os.getcwd()) / top]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        roots += [Path(location) for location in spec.submodule_search_locations or ()]
        if spec.origin and not rest:
            roots.append(Path(spec.origin).with_suffix(""))
    for root in roots:
        base = root.joinpath(*rest)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None
