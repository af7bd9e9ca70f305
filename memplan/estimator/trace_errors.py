"""One clear message for a step that failed under fake tensors: where, why, and what to do."""

from __future__ import annotations

import os
import re
import traceback

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)

from memplan.errors import SettingsError, TraceError
from memplan.estimator.leaves import SparseTensorRefused
from memplan.estimator.routed_experts import eager_experts_message, routing_sized_experts_in
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings

# transformers' ViT-family embeddings refuse an image of another size than the config's unless asked to
# interpolate their position embeddings (modeling_vit.py, ViTEmbeddings / ViTPatchEmbeddings)
# ATen's convolution shape check (aten/src/ATen/native/Convolution.cpp, check_shape_forward).
_KERNEL_LARGER = re.compile(r"Calculated padded input size per channel: \(([\d x]+)\)\. Kernel size: \(([\d x]+)\)")
_IMAGE_SIZE_REFUSED = re.compile(r"Input image size \((\d+)\*(\d+)\) doesn't match model \((\d+)\*(\d+)\)")
_PACKING = frozenset({torch.ops.aten._pack_padded_sequence.default})


def trace_failure(
    error: Exception, module: str | None, spec: ModelSpec, batch: object = None
) -> TraceError | SettingsError:
    refused = _IMAGE_SIZE_REFUSED.search(str(error))
    if refused is not None and spec.ref.inputs is None:  # memplan made the batch: the user's --image-size it was
        size, height, width = refused.group(1), refused.group(3), refused.group(4)
        square = f"; give --image-size {height} or leave it out" if height == width else ""
        return SettingsError(
            f"--image-size {size}: {spec.name} takes {height}×{width} images (its position embeddings are sized "
            f"for them){square}"
        )
    too_small = _KERNEL_LARGER.search(str(error))
    if too_small is not None and spec.ref.inputs is None and _holds_images(batch):
        # memplan made the batch, images of --image-size: smaller than a convolution's kernel (a ViT's patch)
        return SettingsError(
            f"--image-size: {spec.name}'s convolution in {module or 'the model'} has a {too_small.group(2)} kernel, "
            f"larger than the {too_small.group(1)} input it gets; give a larger --image-size, or leave it out for "
            "the model's own"
        )
    if module:
        where = f"in module {module}"
    elif _raised_in_backward(error):  # the backward of an op that has no module's name (a boolean mask's index)
        where = "in the backward pass"
    else:
        where = "outside any module (loss or optimizer)"
    op = getattr(error, "func", None)
    if isinstance(error, SparseTensorRefused):
        named = f"op {op} " if op is not None else "an op "
        if not error.taken and _raised_in_backward(error):  # a sparse=True embedding's gradient
            what = (
                "makes a sparse gradient (F.embedding or F.embedding_bag with sparse=True), which memplan does not "
                "model: estimate with sparse=False, whose dense gradient is at least as large while a batch holds "
                "fewer distinct rows than the table"
            )
        else:
            what = (
                f"{'takes' if error.taken else 'makes'} a sparse tensor ({error.layout}), which memplan does not "
                "model (it counts memory by each tensor's storage, and a sparse tensor's is its indices' and "
                "values'): pass a model that keeps its tensors dense"
            )
        return SettingsError(f"cannot trace {spec.name}: {named}{where} {what}")
    if op in _PACKING and isinstance(error, DataDependentOutputException | DynamicOutputShapeException):
        # torch.nn.utils.rnn's packing: the lengths' values make the packed data's shape and the batch sizes that
        # RNN.cpp's PackedLayer reads step by step
        return TraceError(
            f"cannot trace {spec.name}: op {op} {where} packs sequences (torch.nn.utils.rnn.pack_padded_sequence), "
            "which memplan's trace does not support: their lengths decide each step's batch size, and memplan's "
            "tensors have no values; pad instead (give the recurrent layer the padded batch) or pass a model "
            "without packing"
        )
    if isinstance(error, DataDependentOutputException | DynamicOutputShapeException):
        reader = _library_line_reading_a_value(error)
        if routing_sized_experts_in(error.__traceback__):
            at = f", read at {reader}" if reader is not None else ""
            return TraceError(
                f"cannot trace {spec.name}: op {op} {where} depends on tensor values{at}: {eager_experts_message()}"
            )
        if reader is not None:  # transformers' or peft's own check (a label range, LyCORIS' module dropout)
            return TraceError(
                f"cannot trace {spec.name}: op {op} {where} depends on tensor values, read at {reader}, in the "
                "library's code rather than yours; that model cannot be traced as the library runs it"
            )
        line = _user_line(error)
        at = f" at {line}" if line is not None else ""
        sized = _VALUE_SIZED.get(getattr(op, "overloadpacket", None))
        if sized is not None:  # an op whose output's size is counted from values: what it was, and a fixed-shape way
            what, fix = sized
            return TraceError(
                f"cannot trace {spec.name}: op {op} {where} depends on tensor values{at}: {what}, which tensors "
                f"without values cannot size; {fix}"
            )
        return TraceError(
            f"cannot trace {spec.name}: op {op} {where} depends on tensor values{at} "
            "(data-dependent control flow, .item() or a data-dependent shape); "
            "make that code shape-only or pass a model without it"
        )
    if isinstance(error, UnsupportedOperatorException):
        return TraceError(
            f"cannot trace {spec.name}: op {op} {where} has no fake-tensor implementation; "
            "memplan cannot predict its memory (report it with --debug output)"
        )
    if isinstance(error, RuntimeError) and "does not require grad and does not have a grad_fn" in str(error):
        # autograd's refusal of a loss that no trainable parameter reached
        return SettingsError(
            f"the loss of {spec.name} does not depend on any parameter that trains (autograd: it does not require "
            "grad): its forward runs under torch.no_grad() or detaches, or, with --lora, the adapters are on layers "
            "the forward never calls (adapt layers it calls, with --lora-targets)"
        )
    if module is None and _raised_in_loss(error, spec.ref.loss):
        said = str(error).splitlines()[0] if str(error) else ""
        if isinstance(error, RuntimeError):  # torch's, from a call in the loss: a fake tensor's limit, maybe
            return TraceError(
                f"cannot trace {spec.name} in the loss function --loss {spec.ref.loss}: {type(error).__name__}: "
                f"{said}; rerun with --debug for the traceback"
            )
        return TraceError(
            f"the loss function --loss {spec.ref.loss} raised {type(error).__name__}: {said} (memplan calls it under "
            "fake tensors, with the model's output and the batch); fix it, or rerun with --debug for the traceback"
        )
    hint = ""
    if module and spec.ref.inputs is not None:  # the user's own batch may not be what the model takes
        hint = f"; check that the batch from --inputs {spec.ref.inputs} ({_describe_batch(batch)}) is what it takes"
    return TraceError(
        f"cannot trace {spec.name} {where}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        f"{hint}; rerun with --debug for the traceback"
    )


def _holds_images(batch: object) -> bool:
    """Whether memplan's batch is images (transformers' vision models take `pixel_values`)."""
    return isinstance(batch, dict) and "pixel_values" in batch


def _raised_in_loss(error: Exception, loss: str | None) -> bool:
    """Whether the user's --loss function's own code raised `error`."""
    if loss is None:
        return False
    try:
        from memplan.models.imports import import_object

        code = getattr(import_object(loss, "loss"), "__code__", None)
    except Exception:  # noqa: BLE001  (it was imported once already; whatever fails now, the generic message stands)
        return False
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    # raised by the loss function's own code: not by torch below it, where a fake tensor's limits would be memplan's
    return frame is not None and frame.tb_frame.f_code is code


def _describe_batch(batch: object) -> str:
    """Shapes and dtypes of a batch, short: `tensor (2, 11) float32`, `x: tensor (2, 8) int64`."""

    def one(value: object) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__

    if isinstance(batch, dict):
        return ", ".join(f"{key}: {one(value)}" for key, value in batch.items())
    if isinstance(batch, tuple | list):
        return ", ".join(one(value) for value in batch)
    return one(batch)


def step_failure(error: Exception, settings: TrainingSettings) -> TraceError:
    reader = _library_line_reading_a_value(error)
    if reader is not None:
        # torch.optim.LBFGS tests its gradient's size against a tolerance (`if opt_cond:`): the step is the user's,
        # the branch is the library's, which the user cannot make shape-only
        return TraceError(
            f"--step {settings.step} failed under fake tensors: {reader} reads a tensor's value to decide what to do "
            "next, which tensors without values do not have; a step through that library code cannot be traced "
            f"({type(error).__name__}; use --debug for the traceback)"
        )
    return TraceError(
        f"--step {settings.step} failed under fake tensors ({type(error).__name__}: {error}); it is called as "
        "fn(model, batch, optimizer) and must run on tensors without values (no data-dependent Python control "
        "flow); use --debug for the traceback"
    )


# Where torch's own tensor machinery runs (fake tensors, dispatch, the engine, the Python wrappers of public ops such
# as torch/functional.py's unique): never the code that asked. torch.optim's optimizers are library code of their own.
_TORCH = f"{os.sep}torch{os.sep}"
_TORCH_LIBRARIES = (f"{os.sep}torch{os.sep}optim{os.sep}",)
_MEMPLAN = f"{os.sep}memplan{os.sep}"


def _machinery(filename: str) -> bool:
    if _MEMPLAN in filename:
        return True
    return _TORCH in filename and not any(library in filename for library in _TORCH_LIBRARIES)


_MASK_FIX = (
    "keep the full shape instead: F.cross_entropy(..., ignore_index=-100) for masked labels, torch.where(mask, x, 0) "
    "or x * mask (a masked sum divided by mask.sum() for a mean) elsewhere"
)
# Ops whose output's size is a count of values (their `dynamic_output_shape` tag, a fake tensor refusing them): what
# user code calls them as, and a fixed-shape way to the same loss.
_VALUE_SIZED = {
    torch.ops.aten.nonzero: (
        "a boolean-mask index (`x[mask]`), torch.nonzero or torch.where(cond) with one argument makes as many rows "
        "as the mask has true values",
        _MASK_FIX,
    ),
    torch.ops.aten.masked_select: ("torch.masked_select makes as many values as the mask has true values", _MASK_FIX),
    **{
        packet: (
            "torch.unique makes as many values as the input has distinct ones",
            "give a fixed-size form instead (all values, or torch.zeros(n).scatter_ over a known number n)",
        )
        for packet in (torch.ops.aten._unique2, torch.ops.aten.unique_dim, torch.ops.aten.unique_consecutive)
    },
    torch.ops.aten.repeat_interleave: (
        "repeat_interleave with a tensor of repeats makes as many rows as their sum",
        "pass its output_size= (the sum, as a Python int) or repeat a fixed number of times",
    ),
    torch.ops.aten.bincount: (
        "torch.bincount makes max(input) + 1 counts (at least minlength)",
        "count into a fixed number n of bins instead: torch.zeros(n).index_add_(0, input, torch.ones(len(input)))",
    ),
}


def _innermost_caller(error: Exception) -> traceback.FrameSummary | None:
    """The innermost frame of `error`'s traceback outside torch's machinery and memplan (user or library code)."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.endswith(".pyc")]
    return next((frame for frame in reversed(frames) if not _machinery(frame.filename)), None)


def _user_line(error: Exception) -> str | None:
    """Where the user's own code (not torch's, memplan's or an installed library's) called into what raised `error`,
    as "file.py:line (`code`)"; None where no such frame is in the traceback (an op in the backward pass)."""
    caller = _innermost_caller(error)
    if caller is None or _is_installed(caller.filename):
        return None
    return f"{os.path.basename(caller.filename)}:{caller.lineno} (`{(caller.line or '').strip()}`)"


def _library_line_reading_a_value(error: Exception) -> str | None:
    """Where a value-dependent error was raised from an installed library's code (torch.optim, peft, ...), as
    "path:line (`code`)" relative to the package; None where it came from the user's own code or is of another kind."""
    if not isinstance(error, DataDependentOutputException | DynamicOutputShapeException):
        return None
    caller = _innermost_caller(error)
    if caller is None or not _is_installed(caller.filename):
        return None
    parts = caller.filename.split(os.sep)
    root = max(i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")) + 1
    return f"{'/'.join(parts[root:])}:{caller.lineno} (`{(caller.line or '').strip()}`)"


def _raised_in_backward(error: Exception) -> bool:
    """Whether the error came out of the autograd engine (torch/autograd/graph.py `_engine_run_backward`)."""
    return any(frame.name == "_engine_run_backward" for frame in traceback.extract_tb(error.__traceback__))


def _is_installed(filename: str) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in filename.split(os.sep))
