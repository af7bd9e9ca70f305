"""Turn what the user named into a `ModelSpec`: how to build the model, its batch, and its loss."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import itertools
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memplan.errors import InputsError, LossError, MemplanError, UnknownModelError, UsageError, UserCodeError
from memplan.models.batches import IMAGE_TASKS, TASKS, resolve_lengths, sequence_limit, synthesize_batch
from memplan.models.hf import HFSource, build_hf_model, model_types, resolve_hf
from memplan.models.imports import import_object, is_import_path
from memplan.models.presets import all_presets
from memplan.settings import TrainingSettings

Batch = torch.Tensor | tuple | dict


@dataclass(frozen=True)
class ModelRef:
    """How the user named a model: what `resolve_model` takes, and what a worker process resolves again."""

    name: str
    inputs: str | None = None
    loss: str | None = None
    task: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to run the canonical loop for one model, in any tensor mode."""

    ref: ModelRef  # how the user named it
    build: Callable[[TrainingSettings], nn.Module]
    make_batch: Callable[[TrainingSettings, torch.dtype], Batch]
    loss_of: Callable[[Any, Batch], torch.Tensor]
    settings_for: Callable[[TrainingSettings], TrainingSettings]
    # The longest --seq-len the model's position embeddings allow; None where no limit is known.
    max_seq_len: int | None = None
    # What the answer should say about how the model was read (the head memplan chose for a config that names none).
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.ref.name


def refuse_loss_with_step(loss: object, settings: TrainingSettings) -> None:
    """A loss function is the canonical loop's; with --step the user's function computes its own, and a --loss
    given beside it would be ignored without a word."""
    if loss is not None and settings.step is not None:
        raise UsageError("--step runs your whole iteration, its loss included: leave out --loss")
    if loss is not None and settings.label_smoothing:
        # the Trainer's own compute_loss_func would replace the label smoother; memplan traces the smoother
        raise UsageError(
            "--loss and label smoothing (label_smoothing_factor) both name the step's loss: leave out one of them"
        )


def call_model(model: nn.Module, batch: Batch) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


def default_loss(output: Any, batch: Batch) -> torch.Tensor:
    """A scalar output is the loss; otherwise `output.loss` or `output["loss"]`."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0:
            return output
        raise LossError(
            f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss; "
            "pass --loss package.module:fn where fn(output, batch) returns the loss"
        )
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    raise LossError(
        f"the model output ({type(output).__name__}) has no scalar `loss`; "
        "pass --loss package.module:fn where fn(output, batch) returns the loss"
    )


def _check_batch(batch: Any, path: str) -> Batch:
    if isinstance(batch, torch.Tensor | Mapping) or (
        isinstance(batch, tuple) and all(isinstance(item, torch.Tensor) for item in batch)
    ):
        return batch
    raise InputsError(
        f"inputs function {path!r} returned {_a(type(batch).__name__)}; "
        "return a tensor, a tuple of tensors or a dict of keyword arguments"
    )


def _check_signature(function: Callable[..., Any], arguments: tuple, error: type[MemplanError], message: str) -> None:
    """Refuse at once a user function that cannot take the arguments memplan will pass it."""
    try:
        inspect.signature(function).bind(*arguments)
    except TypeError as mismatch:
        raise error(f"{message} ({mismatch})") from mismatch
    except ValueError:
        pass  # builtins without a signature: let the call decide


def _call_user(function: Callable[..., Any], arguments: tuple, what: str) -> Any:
    """Call the user's factory or inputs function; what it raises is one line naming it."""
    try:
        return function(*arguments)
    except MemplanError:
        raise
    except SystemExit as exit_request:
        raise exit_in_user_code(what, exit_request) from exit_request
    except Exception as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if _raised_in_jit_trace(error):
            raise UserCodeError(
                f"{what} calls torch.jit.trace, which checks the module it traced by running it again and comparing "
                f"the outputs' values ({type(error).__name__}: {detail}), and memplan calls the factory under fake "
                "tensors, which have no values; return the eager nn.Module instead (memplan traces the training step "
                "itself), or pass torch.jit.trace check_trace=False"
            ) from error
        raise UserCodeError(
            f"{what} raised {type(error).__name__}{': ' + detail if detail else ''} (memplan calls it under fake "
            "tensors: no real data, no GPU); fix it, or rerun with --debug for the traceback"
        ) from error


def _raised_in_jit_trace(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) came from inside torch.jit.trace (torch/jit/_trace.py): its
    check_trace compares the traced module's outputs with the eager module's by value (`torch.testing.assert_close`),
    which fake tensors fail with torch's bare "Comparing" error."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame, _ in traceback.walk_tb(current.__traceback__):
            if frame.f_code.co_filename.replace("\\", "/").endswith("torch/jit/_trace.py"):
                return True
        current = current.__cause__ or current.__context__
    return False


def exit_in_user_code(what: str, exit_request: SystemExit) -> UserCodeError:
    """The user's code called sys.exit() (or exit()) while memplan ran it: a failure said in one line, where
    the process would otherwise end with the code it gave, 0 for none, and no answer."""
    return UserCodeError(
        f"{what} called sys.exit({exit_request.code!r}) while memplan ran it (under fake tensors: no real data, "
        "no GPU), so there is no answer; keep exits out of what memplan calls, or rerun with --debug"
    )


def _checked_loss(loss: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise LossError(f"loss function {loss!r} must return a scalar tensor, got {got}")
    return value


def _loss_function(loss: str | None) -> Callable[..., Any] | None:
    if not loss:
        return None
    loss_fn = import_object(loss, "loss")
    _check_signature(
        loss_fn, (None, None), LossError, f"loss function {loss!r} must take two arguments, the output and the batch"
    )
    return loss_fn


def _custom_spec(name: str, inputs: str | None, loss: str | None, task: str | None = None) -> ModelSpec:
    factory = import_object(name, "model")
    if task is not None:
        raise UsageError(
            f"--task picks the head memplan builds for a transformers model; {name!r} is your own model, "
            "whose factory builds it: drop --task"
        )
    _check_signature(factory, (), UsageError, f"model factory {name!r} must be callable with no arguments")
    if inputs is None:
        raise UsageError(
            "a custom model needs its batch: pass --inputs package.module:fn where fn(batch_size) returns it"
        )
    inputs_fn = import_object(inputs, "inputs")
    _check_signature(inputs_fn, (1,), InputsError, f"inputs function {inputs!r} must take one argument, the batch size")
    loss_fn = _loss_function(loss)

    def build(settings: TrainingSettings) -> nn.Module:
        model = _call_user(factory, (), f"model factory {name!r}")
        if not isinstance(model, nn.Module):
            raise not_a_module(name, model)
        if any(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers())):
            # Built on torch.device("meta") (no memory, no values), as a model object may be: given storage here as
            # a model object's copy is (tied weights stay tied, which Module.to_empty does not keep), fake under an
            # estimate, real and uninitialized in validate's run (memory does not read values).
            from memplan.models.objects import skeleton

            model = skeleton(model)
        if settings.attn_impl != "sdpa":
            _set_attention(model, settings.attn_impl, name)
        return model

    def make_batch(settings: TrainingSettings, dtype: torch.dtype) -> Batch:
        return _check_batch(_call_user(inputs_fn, (settings.batch_size,), f"inputs function {inputs!r}"), inputs)

    def loss_of(output: Any, batch: Batch) -> torch.Tensor:
        if loss_fn is not None:
            return _checked_loss(loss, loss_fn(output, batch))
        return default_loss(output, batch)

    def settings_for(settings: TrainingSettings) -> TrainingSettings:
        refuse_loss_with_step(loss, settings)
        shaped = [
            flag
            for flag, value in (
                ("--seq-len", settings.seq_len),
                ("--target-len", settings.target_len),
                ("--image-size", settings.image_size),
            )
            if value is not None
        ]
        if shaped:
            raise UsageError(
                f"{', '.join(shaped)} {'shape' if len(shaped) > 1 else 'shapes'} the batch memplan makes for "
                "transformers models; a custom model's "
                f"batch is what --inputs {inputs} returns: size it there"
            )
        return settings

    return ModelSpec(ModelRef(name, inputs, loss), build, make_batch, loss_of, settings_for=settings_for)


def _set_attention(model: nn.Module, attn_impl: str, name: str) -> None:
    """--attn-impl for a custom model: set it on every transformers model inside it, or refuse."""
    transformers_models = [module for module in model.modules() if hasattr(module, "set_attn_implementation")]
    if not transformers_models:
        raise UsageError(
            f"--attn-impl {attn_impl} applies to transformers models, and {name!r} contains none; "
            "choose the attention in your model's code instead"
        )
    for module in transformers_models:
        module.set_attn_implementation(attn_impl)


def _a(noun: str) -> str:
    """The noun with its article: "an int", "a list"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' or noun == 'ndarray' else 'a'} {noun}"


def not_a_module(name: str, built: object) -> UsageError:
    """The mistake of a model factory that returned something else than a module."""
    return UsageError(f"model factory {name!r} returned {_a(type(built).__name__)}, not a torch.nn.Module")


def _suggest(name: str) -> str:
    """Close spellings of presets and model types (a hub id that is a preset's resolves to it). At difflib's
    default cutoff, 0.6, 'nosuchmodel' was asked "did you mean neucodec?"."""
    candidates = list(all_presets()) + model_types()
    close = difflib.get_close_matches(name.lower(), list(dict.fromkeys(candidates)), n=3, cutoff=0.7)
    if "/" in name and not close:  # a hub id: try its last part against the preset names
        close = difflib.get_close_matches(name.rsplit("/", 1)[1].lower(), list(all_presets()), n=3, cutoff=0.7)
    return f"did you mean {', '.join(close)}? " if close else ""


def resolve_model(
    name: str, *, inputs: str | None = None, loss: str | None = None, task: str | None = None
) -> ModelSpec:
    """Presets, transformers model types, config paths, cached hub ids, or `pkg.mod:callable`."""
    if task is not None and task not in TASKS:
        raise UsageError(f"--task must be one of {', '.join(TASKS)}; got {task!r}")
    if is_import_path(name):
        return _custom_spec(name, inputs, loss, task)
    if inputs is not None:
        meant = _meant_import_path(name)
        if meant is not None:  # a custom model, misspelt: dropping --inputs would not help
            raise UsageError(
                f"{name!r} is not of the form package.module:callable, which names a custom model; did you mean "
                f"{meant}?"
            )
        raise UsageError(
            f"--inputs gives a custom model (package.module:callable) its batch; for {name!r} memplan makes "
            "the batch from the model's task: drop --inputs and size it with --batch-size / --seq-len / --image-size"
        )
    return _hf_spec(name, loss, task)


def _meant_import_path(name: str) -> str | None:
    """The import path a misspelt custom model was meant to be (`pkg/models.py:build`, `pkg.models.build`,
    `pkg.models:`), or None where `name` does not look like one."""
    module, colon, function = name.partition(":")
    if colon:
        module = module.removesuffix(".py").replace("/", ".").replace("\\", ".").strip(".")
        meant = f"{module}:{function or 'your_function'}"
        if ":" in function:  # two colons: the path was meant with a dot where one of them stands
            meant = f"{module}.{function.replace(':', '.', function.count(':') - 1)}"
        return meant if module and meant != name else None
    parts = name.split(".")
    if name.endswith(".json") or (Path(name).exists() and not name.endswith(".py")):
        return None  # a config file or a model's folder: the --inputs message says what to do
    if name.endswith(".py"):
        return f"{name.removesuffix('.py').replace('/', '.').strip('.')}:your_function"
    if len(parts) >= 2 and all(part.isidentifier() for part in parts):
        return f"{'.'.join(parts[:-1])}:{parts[-1]}"
    return None


def _hf_spec(name: str, loss: str | None, task: str | None) -> ModelSpec:
    source = resolve_hf(name, task)
    if source is None and Path(name).is_file() and name.endswith(".py"):
        raise UnknownModelError(f"{name} is Python source: give the function that builds its model as module:function")
    if source is None and name and Path(name).exists():
        raise UnknownModelError(f"{name} is neither a config.json nor a model's folder holding one")
    if source is None and (name.startswith((".", "/", "~")) or name.endswith(".json")):
        raise UnknownModelError(f"no file or folder {name}: give the path of a config.json or of a model's folder")
    if source is None:
        raise UnknownModelError(
            f"unknown model {name!r}: {_suggest(name)}"
            "`memplan presets` lists the presets; also accepted are a transformers model type, "
            "a config.json or model directory, a cached hub id, or package.module:callable"
        )
    loss_fn = _loss_function(loss)

    def settings_for(settings: TrainingSettings) -> TrainingSettings:
        refuse_loss_with_step(loss, settings)
        return resolve_lengths(source.config, source.task, settings)

    def make_batch(settings: TrainingSettings, dtype: torch.dtype) -> Batch:
        return synthesize_batch(source.config, source.task, settings, dtype)

    def loss_of(output: Any, batch: Batch) -> torch.Tensor:
        return _checked_loss(loss, loss_fn(output, batch)) if loss_fn else default_loss(output, batch)

    return ModelSpec(
        ref=ModelRef(name, loss=loss, task=task),
        build=lambda settings: build_hf_model(source, settings.attn_impl),
        make_batch=make_batch,
        loss_of=loss_of,
        settings_for=settings_for,
        max_seq_len=sequence_limit(source.config, source.task) if source.task not in IMAGE_TASKS else None,
        notes=_guessed_head_notes(source, name),
    )


def _guessed_head_notes(source: HFSource, name: str) -> tuple[str, ...]:
    """Where the config names no head (no --task, no preset, no `architectures`), which one memplan trains; where its
    architecture trains for several tasks, which one memplan took."""
    if source.other_tasks:
        others = " or ".join(f"--task {task}" for task in source.other_tasks)
        return (
            f"transformers lists {name}'s {_architecture_name(source)} under {source.task} and "
            f"{', '.join(source.other_tasks)}: this is its {source.task} step; {others} estimates the other",
        )
    if source.guessed_class is None:
        return ()
    return (
        f"{name} names no head, so memplan trains {source.guessed_class} ({source.task}); --task picks another "
        f"({', '.join(TASKS)})",
    )


def _architecture_name(source: HFSource) -> str:
    """The architecture the config names (its first), for the notes."""
    return next(iter(getattr(source.config, "architectures", None) or []), source.config.model_type)
