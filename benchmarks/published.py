"""memplan's cuda predictions beside training-memory figures people measured on real GPUs and published.

Usage (from the repository root):  python benchmarks/published.py [ID ...]

The measurements are in benchmarks/published.json: each with its source, the exact quote, the
settings as the source states them, which figure it is (nvidia-smi, max_memory_reserved or
max_memory_allocated) and memplan's reading of those settings ("memplan"), with the caveats where
the two cannot match exactly. Nothing in memplan was fitted to these rows: they are all a check.
The one number taken from a source is a CUDA context the same source measured (the HF docs'
`torch.ones((1, 1)).to("cuda")` step), passed as --cuda-context would be; for the gpumemnet-* rows,
the fixed part (context and what cuDNN keeps outside the allocator) fitted on the same lab's other
runs on the same machine (benchmarks/gpumemnet_conv.py's calibration half), not on these rows.

Prints one markdown row per measurement and the median and worst error per figure.

A second column replays the rows whose source ran an older torch that kept more memory than the
installed one (a row's "source_torch_differences"), with that older behaviour put back into the
trace; see SOURCE_TORCH_DIFFERENCES. memplan itself models the installed torch: the first column
is its answer, the second tells a version difference from a modelling miss.

Most rows name a transformers model (a hub id, or a "config" written to a folder). The rasbt-vit-*,
rasbt-vitft-* and gpumemnet-* rows trace torchvision's own models as the sources' scripts build them,
the llmfs-* rows the LLMs-from-scratch book's GPT model: their "model", "inputs" and "loss" are import
paths into benchmarks/published_models.py, given to memplan as --model/--inputs/--loss would be. The
torchvision rows need torchvision (matching the installed torch), which memplan itself does not depend
on: `pip install torchvision`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers.utils import logging  # noqa: E402

from benchmarks.published_models import TORCHVISION_FACTORIES  # noqa: E402
from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.trace import trace_step  # noqa: E402
from memplan.models.source import resolve_model  # noqa: E402
from memplan.settings import TrainingSettings  # noqa: E402

MiB = 1 << 20
DATA = Path(__file__).with_name("published.json")
OWN_MODELS = "benchmarks.published_models:"  # rows whose model is a factory in published_models.py


class _SoftmaxSavingInput(torch.autograd.Function):
    """softmax as torch before 1.11 recorded it: its backward node kept the input besides the output."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, dim: int, dtype: torch.dtype | None) -> torch.Tensor:
        probabilities = torch.softmax(scores, dim, dtype=dtype)
        ctx.save_for_backward(scores, probabilities)
        ctx.dim = dim
        return probabilities

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        scores, probabilities = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probabilities, ctx.dim, scores.dtype), None, None


@contextlib.contextmanager
def _softmax_saves_input() -> Iterator[None]:
    """torch < 1.11: `_softmax`'s derivative was `_softmax_backward_data(grad, result, dim, self)`, so
    autograd kept softmax's input alive until backward although the kernel never reads it
    (pytorch/pytorch#49600 and #64000; fixed by #65242, which passes `self.scalar_type()` instead,
    first released in 1.11 — transformers' `pytorch_utils.softmax_backward_data` branched on
    `is_torch_less_than_1_11` for exactly this signature change). Eager attention thus kept one
    more scores-sized tensor per layer: (batch, heads, seq, seq) in the scores' dtype."""
    plain = torch.nn.functional.softmax

    def softmax(
        input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if torch.is_grad_enabled() and input.requires_grad:
            return _SoftmaxSavingInput.apply(input, dim, dtype)
        return plain(input, dim, dtype=dtype)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = plain


@contextlib.contextmanager
def _foreach_adam_two_intermediates() -> Iterator[None]:
    """torch before July 2023: foreach Adam kept two parameter-sized intermediates alive at once.

    torch 2.0.x and the nightlies until July 2023, `_multi_tensor_adam` in torch/optim/adam.py
    (non-capturable, no amsgrad):

        exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)
        torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)
        denom = torch._foreach_add(exp_avg_sq_sqrt, eps)
        torch._foreach_addcdiv_(device_params, device_exp_avgs, denom, step_size)

    so `exp_avg_sq_sqrt` and `denom` (each the size of all the parameters of the group) were both
    alive at the `_foreach_addcdiv_` and until the function returned (pytorch/pytorch#97712
    "Foreach optimizers use higher memory due to intermediates"; fixed by janeyx99's stack from
    #104898, AdamW, 2023-07-10, to #105193, all landed by 2023-07-31). The installed torch
    computes the same in place, one intermediate:

        exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)
        torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)
        torch._foreach_add_(exp_avg_sq_sqrt, eps)
        torch._foreach_addcdiv_(device_params, device_exp_avgs, exp_avg_sq_sqrt, step_size)

    While `_multi_tensor_adam` runs, the in-place add on the list `_foreach_sqrt` returned becomes
    the old out-of-place `_foreach_add`, and the `_foreach_addcdiv_` that divides by that list
    divides by the new one instead: the old code's ops, allocations and lifetimes, nothing else."""
    adam_module = importlib.import_module("torch.optim.adam")
    plain_adam, plain_sqrt = adam_module._multi_tensor_adam, torch._foreach_sqrt
    plain_add_, plain_addcdiv_ = torch._foreach_add_, torch._foreach_addcdiv_
    denominators: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def sqrt(tensors: Any) -> Any:
        result = plain_sqrt(tensors)
        denominators[id(result)] = (result, [])  # keyed by the list object adam.py holds
        return result

    def add_(tensors: Any, other: Any, **kwargs: Any) -> Any:
        held = denominators.get(id(tensors))
        if held is None or held[0] is not tensors or not isinstance(other, float) or kwargs:
            return plain_add_(tensors, other, **kwargs)
        held[1].extend(torch._foreach_add(tensors, other))  # denom = torch._foreach_add(exp_avg_sq_sqrt, eps)
        return None

    def addcdiv_(tensors: Any, tensor1: Any, tensor2: Any, *args: Any, **kwargs: Any) -> Any:
        held = denominators.get(id(tensor2))
        if held is not None and held[0] is tensor2 and held[1]:
            tensor2 = held[1]
        return plain_addcdiv_(tensors, tensor1, tensor2, *args, **kwargs)

    def multi_tensor_adam(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("capturable") or kwargs.get("amsgrad"):
            return plain_adam(*args, **kwargs)  # the old code's other branches: not reproduced
        torch._foreach_sqrt, torch._foreach_add_, torch._foreach_addcdiv_ = sqrt, add_, addcdiv_
        try:
            return plain_adam(*args, **kwargs)
        finally:
            torch._foreach_sqrt, torch._foreach_add_, torch._foreach_addcdiv_ = plain_sqrt, plain_add_, plain_addcdiv_
            denominators.clear()  # both intermediates die when the function returns, as before

    adam_module._multi_tensor_adam = multi_tensor_adam
    try:
        yield
    finally:
        adam_module._multi_tensor_adam = plain_adam


SOURCE_TORCH_DIFFERENCES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "softmax-saves-input": _softmax_saves_input,
    "foreach-adam-two-intermediates": _foreach_adam_two_intermediates,
}


def predict(row: dict, folder: Path, source_torch: bool = False) -> dict[str, float]:
    """memplan's allocated, reserved and device figures for the row, in MiB (one trace)."""
    memplan = dict(row["memplan"])
    model = memplan.pop("model", None)
    config = memplan.pop("config", None)
    if config is not None:
        (folder / row["id"]).mkdir()
        (folder / row["id"] / "config.json").write_text(json.dumps(config))
        model = str(folder / row["id"])
    task = memplan.pop("task", None)
    inputs = memplan.pop("inputs", None)
    loss = memplan.pop("loss", None)
    context_mib = memplan.pop("cuda_context_mib", None)
    if context_mib is not None:
        memplan["cuda_context"] = int(context_mib * MiB)
    spec = resolve_model(model, inputs=inputs, loss=loss, task=task)
    settings = spec.settings_for(TrainingSettings(**memplan))
    with contextlib.ExitStack() as differences:
        for name in row.get("source_torch_differences", []) if source_torch else []:
            differences.enter_context(SOURCE_TORCH_DIFFERENCES[name]())
        simulation = simulate(trace_step(spec, settings))
    return {
        "max_memory_allocated": simulation.peak_bytes / MiB,
        "max_memory_reserved": simulation.reserved_peak_bytes / MiB,
        "nvidia-smi": (simulation.reserved_peak_bytes + settings.context_bytes) / MiB,
    }


def _needs_torchvision(row: dict) -> bool:
    model = str(row["memplan"].get("model", ""))
    return model.startswith(OWN_MODELS) and model.removeprefix(OWN_MODELS) in TORCHVISION_FACTORIES


def _check_torchvision(rows: list[dict]) -> None:
    """The rows tracing torchvision's models need it importable: say so in one line, not a traceback."""
    if not any(_needs_torchvision(row) for row in rows):
        return
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # missing, or a build that does not load with the installed torch
        ids = " ".join(row["id"] for row in rows if _needs_torchvision(row))
        sys.exit(
            f"published.py: the rows {ids} trace torchvision's models and need torchvision matching torch "
            f"{torch.__version__} (import failed: {type(error).__name__}: {error}); pip install torchvision, "
            "or name only other rows"
        )


def main() -> None:
    logging.set_verbosity_error()
    wanted = set(sys.argv[1:])
    rows = [row for row in json.loads(DATA.read_text()) if not wanted or row["id"] in wanted]
    _check_torchvision(rows)
    folder = Path(tempfile.mkdtemp())
    errors: dict[str, list[float]] = {}
    source_errors: dict[str, list[float]] = {}
    print("| id | GPU | figure | measured (MiB) | predicted (MiB) | error | with the source's torch |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        measured = row["measured_mib"]
        predicted = predict(row, folder)[row["figure"]]
        error = (predicted - measured) / measured
        errors.setdefault(row["figure"], []).append(error)
        source_error = error
        replayed = "same"
        if row.get("source_torch_differences"):
            replayed_mib = predict(row, folder, source_torch=True)[row["figure"]]
            source_error = (replayed_mib - measured) / measured
            replayed = f"{replayed_mib:,.0f} ({source_error:+.1%})"
        source_errors.setdefault(row["figure"], []).append(source_error)
        gpu = row["memplan"]["gpu"]
        cells = [row["id"], gpu, row["figure"], f"{measured:,.0f}", f"{predicted:,.0f}", f"{error:+.1%}", replayed]
        print("| " + " | ".join(cells) + " |", flush=True)
    print()
    for label, table in (("installed torch", errors), ("with the source's torch", source_errors)):
        for figure, values in table.items():
            absolute = [abs(value) for value in values]
            print(
                f"{label}, {figure}: {len(values)} rows, median |error| {statistics.median(absolute):.1%}, "
                f"worst {max(values, key=abs):+.1%}, under-predicted {sum(value < 0 for value in values)}"
            )


if __name__ == "__main__":
    main()
