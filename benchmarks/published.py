"""memplan's cuda predictions beside training-memory figures people measured on real GPUs and published.

Usage (from the repository root):  python benchmarks/published.py [ID ...]

The measurements are in benchmarks/published.json: each with its source, the exact quote, the
settings as the source states them, which figure it is (nvidia-smi, max_memory_reserved or
max_memory_allocated) and memplan's reading of those settings ("memplan"), with the caveats where
the two cannot match exactly. Nothing in memplan was fitted to these rows: they are all a check.
The one number taken from a source is a CUDA context the same source measured (the HF docs'
`torch.ones((1, 1)).to("cuda")` step), passed as --cuda-context would be.

Prints one markdown row per measurement and the median and worst error per figure.

A second column replays the rows whose source ran an older torch that kept more for backward
than the installed one (a row's "source_torch_differences"), with that older behaviour put back
into the trace; see SOURCE_TORCH_DIFFERENCES. memplan itself models the installed torch: the first
column is its answer, the second tells a version difference from a modelling miss.
"""

from __future__ import annotations

import contextlib
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

from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.trace import trace_step  # noqa: E402
from memplan.models.source import resolve_model  # noqa: E402
from memplan.settings import TrainingSettings  # noqa: E402

MiB = 1 << 20
DATA = Path(__file__).with_name("published.json")


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


SOURCE_TORCH_DIFFERENCES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "softmax-saves-input": _softmax_saves_input,
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
    task = memplan.pop("task")
    context_mib = memplan.pop("cuda_context_mib", None)
    if context_mib is not None:
        memplan["cuda_context"] = int(context_mib * MiB)
    spec = resolve_model(model, task=task)
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


def main() -> None:
    logging.set_verbosity_error()
    rows = json.loads(DATA.read_text())
    wanted = set(sys.argv[1:])
    folder = Path(tempfile.mkdtemp())
    errors: dict[str, list[float]] = {}
    source_errors: dict[str, list[float]] = {}
    print("| id | GPU | figure | measured (MiB) | predicted (MiB) | error | with the source's torch |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        if wanted and row["id"] not in wanted:
            continue
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
