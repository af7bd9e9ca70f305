"""`torch.compile`d code in a traced step: traced as its eager original.

A factory may return `torch.compile(model)` (an OptimizedModule holding the model as `_orig_mod`), compile a block
inside it, or a loss may be a compiled function. Left to its default stance, TorchDynamo would compile each frame
that runs inside the compiled code under memplan's fake tensors, memplan's own dispatch modes' Python included
(their `_should_skip_dynamo` is False, memplan.estimator.recorder): a tiny MLP's estimate took 20 s instead of 2,
printed a page of recompile-limit warnings, and what was traced was Dynamo's replay of the eager ops, not the
compiled graph's memory (Inductor's fused kernels and the activations AOTAutograd saves, which differ from eager's).
Under the "force_eager" stance (torch/_dynamo/eval_frame.py) every torch.compile directive is ignored: the step is
the eager model's, as traced for any other model, and the estimate says so (compiled_modules_notes).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def compiled_code_run_eagerly() -> Iterator[None]:
    """Run whatever torch.compile wrapped as plain eager code while the step is traced. An OptimizedModule warns
    of global module hooks on each call (torch/_dynamo/eval_frame.py): memplan's own (its module tracker), which
    only name where each op ran, not the user's: silenced."""
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
        yield


def compiled_module_names(model: nn.Module) -> list[str]:
    """The names of the OptimizedModules (`torch.compile(module)`) in `model`, `model` itself as ""."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is None:
        return []
    return [name for name, module in model.named_modules() if isinstance(module, optimized)]


def compiled_modules_notes(model: nn.Module) -> list[str]:
    names = compiled_module_names(model)
    if not names:
        return []
    what = "the model is" if "" in names else f"{', '.join(names)} {'is' if len(names) == 1 else 'are'}"
    return [
        f"{what} torch.compile'd: memplan traces the eager module it wraps (_orig_mod); the compiled step's memory "
        "differs (Inductor fuses ops and AOTAutograd chooses what the backward saves, usually fewer bytes than "
        "eager), so these figures are those of the uncompiled model"
    ]
