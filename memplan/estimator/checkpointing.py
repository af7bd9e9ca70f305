"""Activation checkpointing, applied identically to fake models (to trace) and real ones (to measure).

Two forms, all non-reentrant `torch.utils.checkpoint`:
- one module: its forward runs under `checkpoint`, as Hugging Face's gradient checkpointing does;
- a segment of consecutive blocks of one `nn.ModuleList`: one checkpoint opens before the first
  block and closes after the last (the way `torch.distributed._composable.checkpoint` wraps one
  module with hooks), so only the first block's inputs are kept; recomputation replays the blocks,
  feeding each the previous block's output where the parent's loop did.

Either form takes a policy: "full" recomputes everything in the backward, "selective" keeps what
memplan.estimator.selective names (torch's selective activation checkpointing).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import (
    _checkpoint_without_reentrant_generator,
    checkpoint,
    noop_context_fn,
)

from memplan.checkpoint_layout import CheckpointLayout
from memplan.errors import SettingsError
from memplan.estimator.leaves import tensors_in
from memplan.estimator.selective import selective_context


def _checkpointing_layer(block: nn.Module) -> bool:
    """Whether the block is one of transformers' decoder/encoder layers: a `GradientCheckpointingLayer`
    (transformers/modeling_layers.py), each of which `gradient_checkpointing_enable` checkpoints whatever its class
    (modeling_utils.py, `_set_gradient_checkpointing`). Told by the class's name and module, not by importing
    transformers for models that are not its."""
    return any(
        cls.__name__ == "GradientCheckpointingLayer" and cls.__module__ == "transformers.modeling_layers"
        for cls in type(block).__mro__
    )


def repeated_block_lists(model: nn.Module) -> list[tuple[str, list[str]]]:
    """The containers of repeated blocks, outermost first, each with its blocks' names in it (a ModuleList's
    indices; a Sequential's children's names, which an OrderedDict or `add_module` makes words: torchvision's ViT
    `encoder.layers.encoder_layer_0`, DenseNet's `features.denseblock1`): `nn.ModuleList`s
    holding at least two blocks, all of the same class or all transformers' layers, and `nn.Sequential`s' composite
    children (modules holding modules of their own) whose class repeats there.

    Hybrid models keep layers of several classes in one list (Jamba's `JambaMambaDecoderLayer` and
    `JambaAttentionDecoderLayer`, `ALL_DECODER_LAYER_TYPES` in modeling_jamba.py; Zamba's and Zamba2's hybrid and
    Mamba layers), all of them GradientCheckpointingLayers, which Hugging Face's gradient checkpointing wraps each:
    an 8-layer Jamba's `--checkpoint all` had checkpointed nothing, 128% above the run with every layer
    checkpointed.

    A list of lists (PVT's and PoolFormer's `encoder.block`, one `nn.ModuleList` of layers per stage, modeling_pvt.py
    and modeling_poolformer.py) is never called itself, nor are its lists: their layers are the blocks, taken list by
    list where all of them together are at least two of one class (`--checkpoint all` had named the stages' lists,
    and was refused: "a ModuleList that is never called itself").

    torchvision and timm keep their blocks in `nn.Sequential`s (torchvision's ResNet `layer1`..`layer4` of
    Bottlenecks, MobileNetV2's `features` of InvertedResiduals between two Conv2dNormActivations; timm's ViT
    `blocks`, whose own `set_grad_checkpointing` checkpoints each of them with `checkpoint_seq`, timm/models/
    _manipulate.py): `--checkpoint all` had checkpointed nothing there. A Sequential of layers (VGG's `features`:
    Conv2d, ReLU, MaxPool2d) has no composite children and no blocks. Where those children are plain Sequentials that
    hold repeated blocks themselves (stages), the blocks inside are taken instead: two stages of six blocks had been
    checkpointed as two blocks, 53% above the same twelve blocks checkpointed one by one (a reviewer's find). A stage
    of a class of its own (timm's ConvNeXtStage, whose `set_grad_checkpointing` checkpoints the blocks inside) stays
    one block."""
    found: list[tuple[str, list[str]]] = []
    taken: list[str] = []  # the lists found and the blocks picked: what lies in them is checkpointed with them

    def inside_taken(name: str) -> bool:
        return any(name == outer or name.startswith(outer + ".") for outer in taken)

    for name, module in model.named_modules():
        if inside_taken(name):
            continue
        if isinstance(module, nn.Sequential):
            # a plain Sequential among them that holds repeated blocks itself is a stage: its blocks are taken when
            # the walk reaches it (torchvision's EfficientNet and ConvNeXt stages, timm's EfficientNet and RegNet)
            picked = [
                child
                for child in _repeated_children(module)
                if not (
                    type(module.get_submodule(child)) is nn.Sequential
                    and _repeated_children(module.get_submodule(child))
                )
            ]
            if picked:
                found.append((name, picked))
                taken.extend(_child_name(name, child) for child in picked)
            continue
        if not isinstance(module, nn.ModuleList):
            continue
        lists = [(name, module)]
        if len(module) and all(isinstance(block, nn.ModuleList) for block in module):
            lists = [(_child_name(name, str(index)), inner) for index, inner in enumerate(module)]
        blocks = [block for _, inner in lists for block in inner]
        if len(blocks) < 2 or any(isinstance(block, nn.ModuleList) for block in blocks):
            continue
        if len({type(block) for block in blocks}) != 1 and not all(_checkpointing_layer(block) for block in blocks):
            continue
        found.extend((list_name, [str(index) for index in range(len(inner))]) for list_name, inner in lists)
        taken.extend(list_name for list_name, _ in lists)
    return found


def _repeated_children(sequential: nn.Sequential) -> list[str]:
    """The names of a Sequential's composite children whose class occurs there at least twice; a container that is
    never called itself (a ModuleList: its owner calls its blocks) is no block."""
    composite = [
        (name, type(child))
        for name, child in sequential.named_children()
        if next(child.children(), None) is not None and not _never_called(child)
    ]
    counts = Counter(cls for _, cls in composite)
    return [name for name, cls in composite if counts[cls] >= 2]


def _child_name(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def block_names(model: nn.Module) -> list[str]:
    """Qualified names of every block of every repeated-block container, in module order."""
    names = [_child_name(name, child) for name, children in repeated_block_lists(model) for child in children]
    order = {name: position for position, (name, _) in enumerate(model.named_modules())}
    return sorted(names, key=order.__getitem__)  # (a stage's blocks are found after the Sequential that holds it)


_recomputing = 0  # recomputations running now (the backward replaying a checkpointed forward)


def recomputing() -> bool:
    """Whether a checkpointed forward is being recomputed in the backward. Its ops run inside the
    backward formula that unpacked a saved tensor, and those a custom autograd Function's forward
    runs (bitsandbytes' MatMul4Bit) even with grad mode off, as formula ops do; they are forward
    ops all the same, whose inputs are freed as eagerly as in the first forward."""
    return _recomputing > 0


@contextlib.contextmanager
def _counted_as_recomputation() -> Iterator[None]:
    global _recomputing
    _recomputing += 1
    try:
        yield
    finally:
        _recomputing -= 1


def _recomputable(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward`, counted as a recomputation when the backward calls it (checkpoint's unpack hook)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._current_autograd_node() is None:
            return forward(*args, **kwargs)
        with _counted_as_recomputation():
            return forward(*args, **kwargs)

    return run


def _context_fn(policy: str) -> Callable[[], Any]:
    return selective_context() if policy == "selective" else noop_context_fn


def checkpoint_module(module: nn.Module, policy: str = "full") -> Callable[[], None]:
    """Non-reentrant checkpointing of one module's forward (kwargs pass through); returns the undo.

    The module is an argument of the partial that becomes its forward, not a closure's cell: copy.deepcopy
    and pickle copy a partial's arguments (through their memo), so a copy of the model (an EMA or reference
    model, memplan's own skeleton of a model object) checkpoints its own blocks with its own weights, and
    `torch.save(model)` can name the function. A forward set on the instance before (another library's
    wrapper) is the one checkpointed, and the undo puts it back."""
    own = vars(module).get("forward")
    module.forward = functools.partial(_checkpointed_forward, module, policy, own)  # type: ignore[method-assign]

    def undo() -> None:
        if own is None:
            del module.forward
        else:
            module.forward = own  # type: ignore[method-assign]

    return undo


def _checkpointed_forward(
    module: nn.Module, policy: str, own: Callable[..., Any] | None, *args: Any, **kwargs: Any
) -> Any:
    forward = own if own is not None else type(module).forward.__get__(module)
    return checkpoint(_recomputable(forward), *args, use_reentrant=False, context_fn=_context_fn(policy), **kwargs)


class LayoutModuleMissing(SettingsError):
    """A layout names a module the model does not have (a plan made for another model, a name mistyped)."""


class SegmentError(SettingsError):
    """A segment whose blocks are not chained output-to-input by their parent's loop."""


@dataclass
class _Segment:
    """Hooks that put blocks[0] … blocks[-1] under one non-reentrant checkpoint."""

    name: str
    blocks: list[nn.Module]
    policy: str = "full"
    # For each later block: its call as a pytree, with tensor leaves given as ("prev", i), the i-th
    # tensor of the previous block's output, or ("input", i), the i-th tensor of the first call.
    templates: list[tuple[list[Any], Any] | None] = field(default_factory=list)
    generator: Generator[None, None, None] | None = None
    first_inputs: list[torch.Tensor] = field(default_factory=list)
    previous_output: list[torch.Tensor] = field(default_factory=list)
    replaying: bool = False
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.templates = [None] * len(self.blocks)
        self.handles = []
        for position, block in enumerate(self.blocks):
            self.handles.append(
                block.register_forward_pre_hook(functools.partial(self._pre, position), with_kwargs=True)
            )
            self.handles.append(block.register_forward_hook(functools.partial(self._post, position), always_call=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _pre(self, position: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.replaying:
            return
        if position == 0:
            # a forward that stopped inside the segment where no hook ran (Ctrl-C, a raise between two blocks)
            self._abandon()
            self.first_inputs = tensors_in((args, kwargs))
            self.generator = _checkpoint_without_reentrant_generator(
                self._replay, True, _context_fn(self.policy), "default", False, True, *args, **kwargs
            )
            next(self.generator)
            return
        self.templates[position] = self._template(position, args, kwargs)

    def _post(self, position: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self.replaying:
            return
        # A block that raised: torch runs always_call hooks from its `except Exception` with no output
        # (Module._call_impl). The caller may catch it and go on (an out-of-memory retry, a bad batch); the
        # checkpoint's saved-tensor hooks must not outlive the forward, or every later backward in the
        # process unpacks through them. A BaseException (Ctrl-C) runs no hook: the segment's next forward
        # closes the checkpoint it left open (_pre), and autograd before that still finds its hooks.
        if output is None and sys.exc_info()[1] is not None:
            self._abandon()
            return
        self.previous_output = tensors_in(output)
        if position == len(self.blocks) - 1 or self.generator is None:
            generator, self.generator = self.generator, None
            self.first_inputs, self.previous_output = [], []
            if generator is not None:
                for _ in generator:  # closes the checkpoint (saved-tensor hooks) after the last block
                    raise AssertionError("checkpoint generator yielded twice")

    def _abandon(self) -> None:
        """Close an open checkpoint without finishing it: closing the generator runs its context managers'
        exits, which pop the saved-tensor hooks it pushed."""
        generator, self.generator = self.generator, None
        self.first_inputs, self.previous_output = [], []
        if generator is not None:
            generator.close()

    def _template(self, position: int, args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
        leaves, spec = tree_flatten((args, kwargs))
        template: list[Any] = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                template.append(leaf)
                continue
            source = _find(leaf, self.previous_output, "prev") or _find(leaf, self.first_inputs, "input")
            if source is None:
                raise SegmentError(
                    f"cannot checkpoint {self.name} as one segment: block {position} of it takes a tensor that "
                    "is neither the previous block's output nor an input of the first block; checkpoint its "
                    "blocks one by one instead"
                )
            template.append(source)
        return template, spec

    def _replay(self, *args: Any, **kwargs: Any) -> None:
        """Recompute the segment from the first block's inputs (called by checkpoint's unpack hook)."""
        self.replaying = True
        try:
            with _counted_as_recomputation():
                self._replay_blocks(*args, **kwargs)
        finally:
            self.replaying = False

    def _replay_blocks(self, *args: Any, **kwargs: Any) -> None:
        first_inputs = tensors_in((args, kwargs))
        output = self.blocks[0](*args, **kwargs)
        for block, recorded in zip(self.blocks[1:], self.templates[1:], strict=True):
            assert recorded is not None, "a segment is replayed only after its forward ran"
            template, spec = recorded
            previous = tensors_in(output)
            leaves = [
                (previous if item[0] == "prev" else first_inputs)[item[1]] if _is_source(item) else item
                for item in template
            ]
            call_args, call_kwargs = tree_unflatten(leaves, spec)
            output = block(*call_args, **call_kwargs)


class _Source(tuple):
    """A template slot: ("prev" | "input", tensor index)."""


def _is_source(item: Any) -> bool:
    return isinstance(item, _Source)


def _find(tensor: torch.Tensor, candidates: list[torch.Tensor], kind: str) -> _Source | None:
    for index, candidate in enumerate(candidates):
        if candidate is tensor:
            return _Source((kind, index))
    return None


def _resolve(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise LayoutModuleMissing(
            f"the checkpoint layout names module {name!r}, which this model does not have"
        ) from None


def _checkpointable(model: nn.Module, name: str) -> nn.Module:
    module = _resolve(model, name)
    if _never_called(module):
        raise SettingsError(
            f"the checkpoint layout names {name!r}, a {type(module).__name__} that is never called itself (its "
            f"parent calls its blocks), so checkpointing it would checkpoint nothing: name its blocks, e.g. "
            f"{name}.0"
        )
    return module


def _never_called(module: nn.Module) -> bool:
    """A container without a forward of its own (nn.ModuleList, nn.ModuleDict): calling it raises."""
    return type(module).forward is nn.Module.forward


def uncalled_containers(model: nn.Module) -> frozenset[str]:
    """The names of the model's modules that are never called themselves (_never_called)."""
    return frozenset(name for name, module in model.named_modules() if _never_called(module))


def _check_consecutive(model: nn.Module, segment: tuple[str, ...]) -> None:
    parents = {name.rpartition(".")[0] for name in segment}
    children = [name.rpartition(".")[2] for name in segment]
    parent = _resolve(model, next(iter(parents))) if len(parents) == 1 and next(iter(parents)) else None
    # An nn.Sequential calls its children one after another as a ModuleList's owner does: _Segment's hooks on
    # each block see the same sequence (a ResNet stage's bottlenecks, `plan --candidates` matching them); its
    # children are in order by position, whatever their names (an OrderedDict's words).
    order = [name for name, _ in parent.named_children()] if isinstance(parent, nn.ModuleList | nn.Sequential) else []
    positions = [order.index(child) for child in children if child in order]
    consecutive = len(positions) == len(children) and positions == list(
        range(positions[0], positions[0] + len(children))
    )
    if not consecutive:
        raise SettingsError(
            f"checkpoint segment {segment[0]} … {segment[-1]} is not a run of consecutive blocks of one ModuleList "
            "or Sequential"
        )


# Set on each module apply_layout checkpoints, until its undo: a second layout on the same model would nest
# checkpoints (each recomputing what the outer one recomputes again).
CHECKPOINTED_MARK = "_memplan_checkpointed"


def apply_layout(model: nn.Module, layout: CheckpointLayout) -> Callable[[], None]:
    """Checkpoint `model` in place as `layout` says; returns the function that undoes it.

    Every name and segment is checked before any module is touched, so a layout that is refused leaves the
    model as it was; so is a model that a layout checkpoints already."""
    already = [name for name, module in model.named_modules() if getattr(module, CHECKPOINTED_MARK, False)]
    if already:
        raise SettingsError(
            f"this model is checkpointed already (module {already[0]!r}): apply a plan once, to a model built afresh"
        )
    resolved: list[tuple[tuple[str, ...], list[nn.Module], str]] = []
    for segment, policy in zip(layout.segments, layout.policies, strict=True):
        modules = [_checkpointable(model, name) for name in segment]
        if len(segment) > 1:
            _check_consecutive(model, segment)
        resolved.append((segment, modules, policy))
    undos: list[Callable[[], None]] = []
    for segment, modules, policy in resolved:
        if len(segment) == 1:
            undos.append(checkpoint_module(modules[0], policy))
        else:
            undos.append(_Segment(name=f"{segment[0]}…{segment[-1]}", blocks=modules, policy=policy).remove)
        for module in modules:
            setattr(module, CHECKPOINTED_MARK, True)

    def undo() -> None:
        for step in reversed(undos):
            step()
        for _, modules, _ in resolved:
            for module in modules:
                vars(module).pop(CHECKPOINTED_MARK, None)

    return undo


@contextlib.contextmanager
def layout_applied(model: nn.Module, layout: CheckpointLayout) -> Iterator[None]:
    undo = apply_layout(model, layout)
    cache_back = key_value_cache_off(model) if layout.segments else _nothing
    try:
        yield
    finally:
        cache_back()
        undo()


def _nothing() -> None:
    pass


def key_value_cache_off(model: nn.Module) -> Callable[[], None]:
    """Turn a Hugging Face model's key/value cache off, as a checkpointed model trains; returns the undo.

    Transformers turns it off under its own gradient checkpointing in training ("`use_cache=True` is
    incompatible with gradient checkpointing"), and apply_plan does under a plan (a recomputed block would
    write the cache again). A model named on the command line is built with it off anyway
    (memplan.models.hf); a model object keeps the user's config, and a plan traced with its cache on would
    count gigabytes its planned run does not hold."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is not True:
        return _nothing
    config.use_cache = False

    def undo() -> None:
        config.use_cache = True

    return undo


def transformers_checkpointed_layers(model: nn.Module) -> list[str]:
    """The modules Hugging Face's `gradient_checkpointing_enable()` checkpoints: every `GradientCheckpointingLayer`
    (modeling_utils.py `_set_gradient_checkpointing` flags each; modeling_layers.py runs a flagged one's forward under
    the checkpoint function), wherever it sits, the outermost of nested ones (memplan's layouts nest no checkpoints;
    Swin's stages hold its layers, both checkpointed there). Empty for a model without them. Where they are not the
    blocks of same-class lists, `repeated_block_lists` picks others: MobileViT's MobileViTLayers sit in one list with
    its MobileNet stages (memplan had checkpointed the transformer layers inside them, and put a real
    gradient_checkpointing_enable() step 30% below its measurement), SwiftFormer's stages beside their embeddings
    (nothing had been checkpointed, 3.4% above)."""
    names: list[str] = []
    for name, module in model.named_modules():
        if _checkpointing_layer(module) and not any(name.startswith(outer + ".") for outer in names):
            names.append(name)
    return names


def _is_transformers_model(model: nn.Module) -> bool:
    """Whether the model is one of transformers' (a `PreTrainedModel`, peft's wrapper's base model included), whose
    `gradient_checkpointing_enable()` a user would call; not a module of the user's that holds one among its own
    blocks. Told by the class's name and module, as _checkpointing_layer tells its layers."""
    root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__ == "transformers.modeling_utils"
        for cls in type(root).__mro__
    )


def unsupported_checkpointing_notes(model: nn.Module, checkpointing: object, checkpointed: list[str]) -> list[str]:
    """`--checkpoint all` / `selective` over a transformers model whose class says it cannot be checkpointed
    (`supports_gradient_checkpointing` False: UperNet's, MobileNetV2's; `gradient_checkpointing_enable()` raises
    "does not support activation checkpointing", modeling_utils.py, and so does a Trainer with
    gradient_checkpointing=True): memplan checkpointed its own blocks, a step the user has to make themselves."""
    if checkpointing not in ("all", "selective") or not checkpointed or not _is_transformers_model(model):
        return []
    root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if getattr(root, "supports_gradient_checkpointing", True):
        return []
    return [
        f"{type(root).__name__} does not support Hugging Face's gradient checkpointing "
        "(gradient_checkpointing_enable() and a Trainer with gradient_checkpointing=True raise on it): "
        f"--checkpoint {checkpointing} checkpointed memplan's repeated blocks instead ({len(checkpointed)} modules, "
        f"{checkpointed[0]} first), which you would checkpoint yourself (torch.utils.checkpoint)"
    ]


def all_blocks_layout(model: nn.Module, policy: str = "full") -> CheckpointLayout:
    """`--checkpoint all` / `selective`: a transformers model's layers as Hugging Face's gradient checkpointing
    wraps them (transformers_checkpointed_layers), any other model's repeated blocks (block_names), a module of the
    user's that holds a transformers model among its blocks included."""
    names = (transformers_checkpointed_layers(model) if _is_transformers_model(model) else []) or block_names(model)
    return CheckpointLayout(segments=tuple((name,) for name in names), policies=(policy,) * len(names))


def apply_checkpointing(model: nn.Module, checkpointing: str | CheckpointLayout) -> list[str]:
    """The settings' `checkpoint` value applied: "none", "all" / "selective" (every repeated block) or a layout."""
    if checkpointing in ("all", "selective"):
        layout = all_blocks_layout(model, "full" if checkpointing == "all" else "selective")
    else:
        layout = checkpointing
    if not isinstance(layout, CheckpointLayout):
        return []
    apply_layout(model, layout)
    if layout.segments:
        key_value_cache_off(model)
        if checkpointing in ("all", "selective"):
            embeddings_output_requires_grad(model)
    return list(layout.modules)


def embeddings_output_requires_grad(model: nn.Module) -> None:
    """What Hugging Face's gradient checkpointing does beside checkpointing the layers, done where it does it: the
    model's own `enable_input_require_grads()`, a forward hook on the input embeddings of every `PreTrainedModel` in
    it (a vision-language model's vision tower included) that makes their output require grad. transformers calls it
    from `gradient_checkpointing_enable()` for a model whose main input is `input_ids`, or one with adapters loaded
    through its own peft integration (modeling_utils.py, `PreTrainedModel._activation_checkpointing_enable`, 5.17 on);
    peft calls it from `get_peft_model` for a model checkpointed before (peft_model.py, `PeftModel.__init__`,
    `_prepare_model_for_gradient_checkpointing`): either order of the two, the hook is there.

    Where the embeddings train, their output requires grad anyway. Where they are frozen (LoRA), it becomes a leaf
    that requires grad, held by its AccumulateGrad node as long as the graph lives (memplan.estimator.eager_lifetimes),
    and the ops between it and the first checkpointed layer save what they save for a backward (CLIP's pre-layernorm
    in LLaVA's tower). A text model's embeddings' output is its first checkpoint's input, which the checkpoint holds
    anyway; a vision-language model's goes into masked_scatter and had been freed: LLaVA and PaliGemma with LoRA and
    --checkpoint all were 2.0-2.4% below the step gradient_checkpointing_enable() trains."""
    if not _is_transformers_model(model):
        return
    root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not getattr(root, "supports_gradient_checkpointing", True):
        return  # gradient_checkpointing_enable() raises: memplan checkpointed its own blocks (the notes say so)
    if root.main_input_name == "input_ids" or getattr(root, "_hf_peft_config_loaded", False):
        root.enable_input_require_grads()
