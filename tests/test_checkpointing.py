"""Checkpoint layouts on real models: same gradients as without, clear errors for impossible layouts."""

import pytest
import torch
from torch import nn

from memplan.checkpoint_layout import CheckpointLayout
from memplan.errors import SettingsError
from memplan.estimator.checkpointing import SegmentError, apply_layout, block_names
from memplan.estimator.loop import micro_batch, prepare
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings


def _gradients(spec, settings):
    torch.manual_seed(0)
    state = prepare(spec, settings)
    torch.manual_seed(1)
    state.batch = spec.make_batch(settings, torch.float32)
    micro_batch(state)
    return [param.grad.clone() for param in state.trainable]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_segment_checkpoint_gives_the_same_gradients(model, tiny_model_dirs):
    spec = resolve_model(str(tiny_model_dirs[model]))
    settings = spec.settings_for(TrainingSettings(batch_size=2, seq_len=32, device="cpu"))
    torch.manual_seed(0)
    blocks = block_names(prepare(spec, settings).model)
    reference = _gradients(spec, settings)
    segmented = _gradients(spec, settings.replace(checkpoint=CheckpointLayout(segments=(tuple(blocks),))))
    assert len(reference) == len(segmented)
    for expected, actual in zip(reference, segmented, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


class _Scaled(nn.Module):
    """The parent changes the hidden state between blocks, so two blocks cannot share a checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * 2
        return x


def test_a_segment_whose_blocks_are_not_chained_is_refused():
    model = _Scaled()
    apply_layout(model, CheckpointLayout(segments=(("blocks.0", "blocks.1"),)))
    with pytest.raises(SegmentError, match="checkpoint its blocks one by one"):
        model(torch.randn(3, 8, requires_grad=True)).sum().backward()


def test_layout_errors_name_the_problem():
    model = _Scaled()
    with pytest.raises(SettingsError, match="does not have"):
        apply_layout(model, CheckpointLayout(segments=(("blocks.7",),)))
    with pytest.raises(SettingsError, match="'blocks', a ModuleList that is never called itself .* e.g. blocks.0$"):
        apply_layout(model, CheckpointLayout(segments=(("blocks",),)))  # checkpointing it would checkpoint nothing
    assert "forward" not in vars(model.blocks)
    with pytest.raises(SettingsError, match="consecutive blocks"):
        apply_layout(nn.Sequential(_Scaled(), _Scaled()), CheckpointLayout(segments=(("0.blocks.1", "1.blocks.0"),)))
    with pytest.raises(SettingsError, match="checkpointed twice"):
        CheckpointLayout(segments=(("blocks.0",), ("blocks.0", "blocks.1")))
    with pytest.raises(SettingsError, match="checkpoints blocks.0.mlp inside blocks.0"):
        CheckpointLayout(segments=(("blocks.0",), ("blocks.0.mlp",)))
    with pytest.raises(SettingsError, match="inside h"):
        CheckpointLayout(segments=(("h.1.attn.proj",), ("h",)))
    CheckpointLayout(segments=(("blocks.1",), ("blocks.10",), ("blocks.1x.mlp",)))  # prefixes that are no parents


def _untouched(model: nn.Module) -> bool:
    return not any(
        "forward" in vars(module) or module._forward_pre_hooks or module._forward_hooks for module in model.modules()
    )


@pytest.mark.parametrize(
    "bad_segment",
    [("blocks.7",), ("head", "blocks.2")],
    ids=["a module the model lacks", "a segment of no ModuleList"],
)
def test_a_layout_refused_at_its_last_segment_leaves_the_model_as_it_was(bad_segment):
    model = _Chained(count=4)
    layout = CheckpointLayout(segments=(("blocks.0",), ("blocks.1",), bad_segment))
    with pytest.raises(SettingsError):
        apply_layout(model, layout)
    assert _untouched(model)


def test_a_model_is_checkpointed_once_until_undone():
    model = _Chained(count=3)
    undo = apply_layout(model, CheckpointLayout(segments=(("blocks.0",), ("blocks.1", "blocks.2"))))
    for again in (("blocks.0",), ("blocks.2",), ("head",)):  # the same module, one in a segment, another one
        with pytest.raises(SettingsError, match="checkpointed already"):
            apply_layout(model, CheckpointLayout(segments=(again,)))
    undo()
    assert _untouched(model)
    apply_layout(model, CheckpointLayout(segments=(("blocks.1",),)))
    assert "forward" in vars(model.blocks[1])


def test_undo_restores_the_plain_forward():
    model = _Scaled()
    undo = apply_layout(model, CheckpointLayout(segments=(("blocks.0",), ("blocks.1",))))
    assert "forward" in vars(model.blocks[0])
    undo()
    assert "forward" not in vars(model.blocks[0])


class _Chained(nn.Module):
    """Blocks that hand each other their output as it is: `scale` reaches each block as a number."""

    def __init__(self, count: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(count))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x).sum()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        # The trailing multiply saves nothing for backward: an early-stopping recomputation skips it.
        return torch.tanh(self.linear(x)) * scale


class _BackwardOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_in_backward(model: nn.Module, forward) -> list[str]:  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = forward(torch.randn(4, 8, requires_grad=True))
    with _BackwardOps() as recorder:
        loss.backward()
    return recorder.ops


def test_a_segment_recomputes_exactly_what_torchs_own_checkpoint_does():
    """Truth: torch.utils.checkpoint over the same blocks called in a row, which stops its
    recomputation once the last saved tensor is back (early stop, torch's default): the ops the
    backward runs, recomputation included, are the same list."""
    torch.manual_seed(0)
    model = _Chained()

    def by_torch(x: torch.Tensor) -> torch.Tensor:
        def blocks(hidden: torch.Tensor) -> torch.Tensor:
            for block in model.blocks:
                hidden = block(hidden, scale=0.5)
            return hidden

        hidden = torch.utils.checkpoint.checkpoint(blocks, x, use_reentrant=False)
        return model.head(hidden).sum()

    expected = _ops_in_backward(model, by_torch)
    apply_layout(model, CheckpointLayout(segments=(("blocks.0", "blocks.1", "blocks.2"),)))
    assert _ops_in_backward(model, model) == expected
    # Three multiplies in the gradients of `* scale`, two recomputed: early stop leaves out the last
    # block's trailing one, which nothing saved (without early stop: six).
    assert expected.count("aten.mul.Tensor") == 5


class _SequentialStack(nn.Module):
    """Its blocks in an nn.Sequential, called as a whole: a ResNet stage's bottlenecks are held so."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).sum()


def test_a_segment_of_a_sequential_s_blocks_recomputes_what_torchs_own_checkpoint_does():
    """`plan --candidates` matching a Sequential's children was refused ("not a run of consecutive blocks of one
    ModuleList") after the planner had chosen such a segment. Truth: torch.utils.checkpoint over those blocks."""
    torch.manual_seed(0)
    model = _SequentialStack()

    def by_torch(x: torch.Tensor) -> torch.Tensor:
        first_two = torch.utils.checkpoint.checkpoint(
            lambda hidden: model.blocks[1](model.blocks[0](hidden)), x, use_reentrant=False
        )
        return model.head(model.blocks[2](first_two)).sum()

    expected = _ops_in_backward(model, by_torch)
    apply_layout(model, CheckpointLayout(segments=(("blocks.0", "blocks.1"),)))
    assert _ops_in_backward(model, model) == expected


def sequential_stack() -> nn.Module:
    return _SequentialStack()


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 8)


class _LayerSequential(nn.Module):
    """Layers in an nn.Sequential, none of them a block of its own (VGG's `features`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).sum()


def layer_sequential() -> nn.Module:
    return _LayerSequential()


def test_checkpoint_all_on_a_model_without_repeated_blocks_says_nothing_is_checkpointed():
    """The header said "checkpoint all blocks" over an unchanged step, without a word: a Sequential of layers holds
    no blocks."""
    import memplan

    source = {"inputs": "tests.test_checkpointing:rows", "batch_size": 4, "device": "cpu"}
    plain = memplan.estimate("tests.test_checkpointing:layer_sequential", **source)
    result = memplan.estimate("tests.test_checkpointing:layer_sequential", **source, checkpoint="all")
    assert result.checkpointed_blocks == () and result.peak_bytes == plain.peak_bytes
    assert any("found no repeated blocks in this model" in note for note in result.notes)
    assert not any("repeated blocks" in note for note in plain.notes)


class _Bottleneck(nn.Module):
    """torchvision's ResNet Bottleneck in small: 1x1, 3x3, 1x1 convolutions with batch norms, a downsampling
    Sequential (a convolution and its norm: layers, no blocks) on the first block of a stage."""

    def __init__(self, channels: int, downsample: bool) -> None:
        super().__init__()
        inner = channels // 2
        self.conv1, self.bn1 = nn.Conv2d(channels, inner, 1, bias=False), nn.BatchNorm2d(inner)
        self.conv2, self.bn2 = nn.Conv2d(inner, inner, 3, padding=1, bias=False), nn.BatchNorm2d(inner)
        self.conv3, self.bn3 = nn.Conv2d(inner, channels, 1, bias=False), nn.BatchNorm2d(channels)
        shortcut = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels))
        self.downsample = shortcut if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


class _SequentialResNet(nn.Module):
    """Stages as torchvision's ResNet keeps them: `layer1`, `layer2`, each an nn.Sequential of Bottlenecks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.layer1 = nn.Sequential(_Bottleneck(16, True), _Bottleneck(16, False), _Bottleneck(16, False))
        self.layer2 = nn.Sequential(_Bottleneck(16, True), _Bottleneck(16, False))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.layer2(self.layer1(torch.relu(self.stem(x))))
        return self.head(features.mean((2, 3))).square().mean()


def test_checkpoint_all_checkpoints_each_block_of_a_sequential_as_torch_does():
    """`--checkpoint all` over torchvision-style stages (blocks in nn.Sequentials) checkpointed nothing, a note
    saying so: the step stayed the plain one. Now each Bottleneck is a block, the downsampling Sequential inside it
    (a convolution and its norm) not. Truth: the same step run plainly, torch's own non-reentrant checkpoint around
    each Bottleneck, measured by the CPU allocator's events."""
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from tests.hand_measure import checkpoint_each, profiled_third_iteration_peak, training_iteration
    from tests.module_specs import loss_returning_spec

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = _SequentialResNet()
        checkpoint_each([*model.layer1, *model.layer2])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(4, 3, 32, 32)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)  # oneDNN off: Slow2d's columns, which memplan counts
    spec = loss_returning_spec("sequential-resnet", _SequentialResNet, (3, 32, 32))
    settings = TrainingSettings(batch_size=4, device="cpu", optimizer="sgd")
    with torch.backends.mkldnn.flags(enabled=False):
        traced = trace_step(spec, settings.replace(checkpoint="all"))
        predicted = simulate(traced).peak_bytes
        plain = simulate(trace_step(spec, settings)).peak_bytes
    assert traced.checkpointed_blocks == ["layer1.0", "layer1.1", "layer1.2", "layer2.0", "layer2.1"]
    assert predicted == measured
    assert plain > 2 * measured  # the plain step: what had been predicted


def test_a_sequential_s_blocks_are_its_composite_children_whose_class_repeats():
    """MobileNetV2's `features`: a Conv2dNormActivation, InvertedResiduals, a Conv2dNormActivation; a Sequential's
    single composite child (a head) and its layers are no blocks; a model that is itself the Sequential names its
    blocks by index."""
    model = nn.Module()
    model.features = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU()),
        _Bottleneck(4, False),
        _Bottleneck(4, False),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()),
    )
    model.head = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    assert block_names(model) == ["features.0", "features.1", "features.2", "features.4"]
    assert block_names(nn.Sequential(_Bottleneck(4, False), _Bottleneck(4, False))) == ["0", "1"]


def test_a_sequential_s_blocks_keep_their_names_and_its_stages_give_way_to_their_blocks():
    """A Sequential built from an OrderedDict names its children by words (torchvision's ViT `encoder_layer_0`):
    the blocks had been named by position, "layers.0", which the model does not have (--checkpoint all refused, FSDP's
    wrapping an internal error). Plain Sequential stages of repeated blocks (torchvision's EfficientNet) had been
    checkpointed whole: their blocks are taken. A segment of named blocks is consecutive by position."""
    from collections import OrderedDict

    model = nn.Module()
    model.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", _Bottleneck(4, False)) for i in range(3)))
    model.stages = nn.Sequential(
        nn.Sequential(_Bottleneck(4, False), _Bottleneck(4, False)),
        nn.Sequential(_Bottleneck(4, False)),  # a stage of one block: no repeated blocks of its own, itself a block
        nn.Sequential(_Bottleneck(4, False), _Bottleneck(4, False)),
    )
    assert block_names(model) == [
        *(f"layers.encoder_layer_{i}" for i in range(3)),
        "stages.0.0",
        "stages.0.1",
        "stages.1",
        "stages.2.0",
        "stages.2.1",
    ]
    undo = apply_layout(model, CheckpointLayout(segments=(("layers.encoder_layer_0", "layers.encoder_layer_1"),)))
    undo()
    with pytest.raises(SettingsError, match="not a run of consecutive blocks"):
        apply_layout(model, CheckpointLayout(segments=(("layers.encoder_layer_0", "layers.encoder_layer_2"),)))


def test_a_segment_passes_non_tensor_arguments_to_its_recomputation_and_checkpoints_every_iteration():
    """Truth: the gradients without checkpointing, and each block's forward running once in the
    forward and once more in the backward (its recomputation), in every iteration."""
    torch.manual_seed(0)
    plain = _Chained()
    segmented = _Chained()
    segmented.load_state_dict(plain.state_dict())
    apply_layout(segmented, CheckpointLayout(segments=(("blocks.0", "blocks.1", "blocks.2"),)))
    calls = []
    segmented.blocks[0].register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(4, 8)
    for iteration in range(2):
        plain(x).backward()
        segmented(x).backward()
        assert len(calls) == 2 * (iteration + 1), iteration
    for expected, actual in zip(plain.parameters(), segmented.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad)


def test_repeated_block_lists_are_the_outermost_lists_of_two_or_more_blocks_of_one_class():
    class _Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))  # inside a block: not a candidate

    model = nn.Module()
    model.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # two classes
    model.single = nn.ModuleList([nn.Linear(2, 2)])  # one block
    model.blocks = nn.ModuleList(_Inner() for _ in range(2))
    model.heads = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    assert block_names(model) == ["blocks.0", "blocks.1", "heads.0", "heads.1"]
    # A model that is itself the list: its blocks are named by their index alone.
    assert block_names(nn.ModuleList(nn.Linear(2, 2) for _ in range(2))) == ["0", "1"]


def test_checkpoint_all_is_the_full_policy_on_every_block():
    from memplan.estimator.checkpointing import all_blocks_layout

    layout = all_blocks_layout(_Chained(2))
    assert layout.segments == (("blocks.0",), ("blocks.1",))
    assert layout.policies == ("full", "full")


def test_a_segment_must_be_consecutive_blocks_of_one_list():
    model = nn.Module()
    model.a = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    model.b = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    for segment in (("a.0", "b.1"), ("a.0", "a.2"), ("a.1", "a.0")):
        with pytest.raises(SettingsError, match="is not a run of consecutive blocks"):
            apply_layout(model, CheckpointLayout(segments=(segment,)))
    message = "checkpoint segment a.0 … a.3 is not a run of consecutive blocks of one ModuleList"
    with pytest.raises(SettingsError, match=message):
        apply_layout(model, CheckpointLayout(segments=(("a.0", "a.1", "a.3"),)))
    apply_layout(model, CheckpointLayout(segments=(("a.1", "a.2"),)))()  # not from the list's start: fine


def test_a_segment_that_cannot_be_replayed_names_the_block():
    class _TakesTheInputTwice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Bilinear(8, 8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.blocks[0](x, x)
            hidden = self.blocks[1](hidden, x)  # the first block's input: replayable
            return self.blocks[2](hidden, x * 2).sum()  # a tensor made between blocks: not

    model = _TakesTheInputTwice()
    apply_layout(model, CheckpointLayout(segments=(("blocks.0", "blocks.1", "blocks.2"),)))
    message = "cannot checkpoint blocks.0…blocks.2 as one segment: block 2 of it takes a tensor that is neither"
    with pytest.raises(SegmentError, match=message):
        model(torch.randn(3, 8, requires_grad=True))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return [parameter.grad.clone() for parameter in model.parameters()]


@pytest.mark.parametrize("segments", [(("blocks.0",), ("blocks.1",)), (("blocks.0", "blocks.1", "blocks.2"),)])
def test_a_copy_of_a_checkpointed_model_is_checkpointed_on_its_own_weights(segments):
    import copy
    import io

    torch.manual_seed(0)
    model = _Chained()
    apply_layout(model, CheckpointLayout(segments=segments))
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.mul_(0.5)  # the copy's weights are its own from here on
    plain = copy.deepcopy(_Chained())
    plain.load_state_dict(copied.state_dict())
    x = torch.randn(4, 8)
    copied_grads = _grads(copied, x)
    assert all(parameter.grad is None for parameter in model.parameters())  # nothing landed on the original
    for expected, actual in zip(_grads(plain, x), copied_grads, strict=True):
        torch.testing.assert_close(actual, expected)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module pickles
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for expected, actual in zip(_grads(model, x), _grads(loaded, x), strict=True):
        torch.testing.assert_close(actual, expected)


class _FailingOnce(nn.Module):
    """A block whose forward raises once when told to (an out-of-memory error, a bad batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.fail: type[BaseException] | None = None

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error("simulated failure inside the segment")
        return torch.tanh(self.linear(x)) * scale


@pytest.mark.parametrize(
    ("failing", "error"), [(0, RuntimeError), (1, RuntimeError), (2, RuntimeError), (1, KeyboardInterrupt)]
)
def test_a_forward_that_fails_inside_a_segment_leaves_autograd_and_the_model_working(failing, error):
    torch.manual_seed(0)
    model = _Chained()
    model.blocks = nn.ModuleList(_FailingOnce() for _ in range(3))
    reference = _Chained()
    reference.blocks = nn.ModuleList(_FailingOnce() for _ in range(3))
    reference.load_state_dict(model.state_dict())
    apply_layout(model, CheckpointLayout(segments=(("blocks.0", "blocks.1", "blocks.2"),)))
    x = torch.randn(4, 8)
    model.blocks[failing].fail = error
    with pytest.raises(error):
        model(x)
    # What else may hold the open checkpoint (a debugger's frames): it must be closed all the same, not left to
    # the moment its last reference goes.
    segment = next(iter(model.blocks[0]._forward_pre_hooks.values())).func.__self__
    held = segment.generator

    def unrelated_autograd_works() -> None:
        unrelated = torch.ones(3, requires_grad=True)
        (unrelated * unrelated).sum().backward()
        torch.testing.assert_close(unrelated.grad, torch.full((3,), 2.0))

    if error is not KeyboardInterrupt:  # torch runs no hook for a BaseException: the model's next forward closes it
        unrelated_autograd_works()
    planned = _grads(model, x)
    unrelated_autograd_works()
    for expected, actual in zip(_grads(reference, x), planned, strict=True):
        torch.testing.assert_close(actual, expected)
    del held


WIDTH = 128


class _GatedBlock(nn.Module):
    """A gated MLP's product with no op after it in the block: its MulBackward0 is the Node whose unpack
    recomputes the block, and it reads each factor in one of its two blocks (`grad * other`, `grad * self`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(self.gate(x)) * self.up(x)


class _GatedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH, bias=False)  # the first block's input requires grad too
        self.blocks = nn.ModuleList([_GatedBlock(), _GatedBlock()])
        self.down_0 = nn.Linear(4 * WIDTH, WIDTH, bias=False)
        self.down_1 = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block, down in zip(self.blocks, (self.down_0, self.down_1), strict=True):
            x = down(block(x))
        return x.sum()


def test_recomputed_saved_tensors_live_until_the_formula_that_unpacked_them_returns():
    """A checkpointed block is recomputed inside the formula of the first Node that unpacks one of its saved tensors
    (here MulBackward0), after the checkpoint unpacked its inputs (a detach, an op of that formula). The tensors the
    recomputation saved were taken for that formula's own temporaries (born after its first op) and freed at their
    last use, the first factor (4 x 64 x 512 float32, 512 KiB) before the formula's second product; the
    formula holds both factors as locals until it returns. Truth: the same step run plainly, torch's own checkpoint
    around each block, measured by the CPU allocator's events (QLoRA's Linear4bit layers leave a gated MLP's
    product as the first such Node: a llama-like model with --quantize nf4 --checkpoint all was short by it)."""
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from tests.hand_measure import checkpoint_each, profiled_third_iteration_peak, training_iteration
    from tests.module_specs import loss_returning_spec

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = _GatedStack()
        checkpoint_each(model.blocks)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(4, 64, WIDTH)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("gated-stack", _GatedStack, (64, WIDTH))
    settings = TrainingSettings(batch_size=4, device="cpu", optimizer="sgd", checkpoint="all")
    traced = trace_step(spec, settings)
    assert traced.checkpointed_blocks == ["blocks.0", "blocks.1"]
    assert simulate(traced).peak_bytes == measured


class _BiasedBlock(nn.Module):
    """An MLP over a 3-D input, its output scaled (a constant factor: the first Node whose unpack recomputes the
    block is the product's): the second Linear's AddmmBackward0 returns the bias's gradient at the rows' size, which
    the engine's validate_outputs sums to the bias's shape after the formula returned."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))) * torch.full((1,), 0.5)


class _BiasedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 64)
        self.blocks = nn.ModuleList(_BiasedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_recomputed_saved_tensor_goes_before_validate_outputs_sums_a_gradient():
    """The unpack hook of torch's non-reentrant checkpoint hands a recomputed tensor to the formula and drops its own
    reference (torch/utils/checkpoint.py, `holder.handles[gid] = None`); the Node keeps only the holder. So it goes as
    the formula returns, before the engine's validate_outputs sums a gradient to its input's shape, where a tensor
    the Node saved itself lives until the Node's variables are released after it (engine.cpp, evaluate_function).
    Held through the sum of the bias's gradient, the prediction was high by that sum's output (512 B here; 128 B on
    timm's Swin with its blocks checkpointed). Truth: the same step run plainly, torch's own checkpoint around each
    block, measured by the CPU allocator's events."""
    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from tests.hand_measure import checkpoint_each, profiled_third_iteration_peak, training_iteration
    from tests.module_specs import loss_returning_spec

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = _BiasedStack()
        checkpoint_each(model.blocks)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(2, 256, 64)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("biased-stack", _BiasedStack, (256, 64))
    settings = TrainingSettings(batch_size=2, device="cpu", optimizer="sgd", checkpoint="all")
    assert simulate(trace_step(spec, settings)).peak_bytes == measured


class _MlpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class _MlpStack(nn.Module):
    """Three blocks; with `reentrant`, the model checkpoints them itself with torch's reentrant checkpoint."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)  # the first block's input requires grad (reentrant's gradients need it)
        self.blocks = nn.ModuleList(_MlpBlock() for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True) if self.reentrant else block(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("reentrant", [False, True], ids=["checkpoint all", "the model's own reentrant checkpoint"])
def test_a_checkpoint_s_copy_of_the_cpu_rng_state_is_counted(reentrant):
    """torch's checkpoint preserves the RNG state by default: it copies the CPU generator's state (a 5,056 B uint8
    tensor, torch.get_rng_state()) as its forward starts and holds it until its recomputation is done with it (the
    reentrant form on its ctx until its graph goes), and its recomputation's fork_rng takes another while it
    runs. No dispatch sees these copies; the prediction was one to three copies low. Truth: the step run plainly,
    torch's own checkpoint (RNG state preserved, as memplan's --checkpoint all and Hugging Face's run it) around
    each block, measured by the CPU allocator's events."""
    from torch.utils.checkpoint import checkpoint

    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from memplan.measure.cpu import measure_cpu
    from tests.hand_measure import profiled_third_iteration_peak, training_iteration
    from tests.module_specs import loss_returning_spec

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = _MlpStack(reentrant)
        if not reentrant:
            for block in model.blocks:
                block.forward = lambda x, forward=block.forward: checkpoint(forward, x, use_reentrant=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(4, 16, WIDTH)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("mlp-stack", lambda: _MlpStack(reentrant), (16, WIDTH))
    checkpointing = "none" if reentrant else "all"
    settings = TrainingSettings(batch_size=4, device="cpu", optimizer="sgd", checkpoint=checkpointing)
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    # validate's counter (a dispatch mode) counts the copies too, or `validate --device cpu` calls this low
    assert measure_cpu(spec, settings).peak_bytes == measured


# A hybrid model whose one list of decoder layers holds two classes (modeling_jamba.py's ALL_DECODER_LAYER_TYPES):
# three Mamba layers and one attention layer, as Jamba's configs interleave them (attn_layer_period 8 there).
TINY_JAMBA = {
    "model_type": "jamba",
    "architectures": ["JambaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "num_experts": 1,
    "attn_layer_period": 4,
    "attn_layer_offset": 2,
    "mamba_d_state": 8,
    "mamba_dt_rank": 4,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_a_hybrid_models_layers_of_two_classes_are_each_checkpointed_as_transformers_does(tmp_path):
    """`--checkpoint all` on Jamba had found no list of same-class blocks and checkpointed nothing (its note said
    so): +128% against the run with every layer checkpointed (8 layers, b2 s64), as Hugging Face's gradient
    checkpointing runs it. Truth: that run, each decoder layer under a non-reentrant checkpoint, measured by the CPU
    allocator's events."""
    import json

    from torch.utils.checkpoint import checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from tests.hand_measure import profiled_causal_lm_peak

    (tmp_path / "config.json").write_text(json.dumps(TINY_JAMBA))
    spec = resolve_model(str(tmp_path))
    settings = spec.settings_for(
        TrainingSettings(batch_size=2, seq_len=16, device="cpu", optimizer="sgd", checkpoint="all")
    )
    predicted = simulate(trace_step(spec, settings)).peak_bytes

    def checkpointed_jamba():  # type: ignore[no-untyped-def]
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_JAMBA, use_cache=False))
        assert len({type(layer) for layer in model.model.layers}) == 2
        for layer in model.model.layers:
            layer.forward = lambda *a, forward=layer.forward, **k: checkpoint(forward, *a, use_reentrant=False, **k)
        return model

    def tokens():  # type: ignore[no-untyped-def]
        input_ids = torch.randint(0, TINY_JAMBA["vocab_size"], (2, 16))
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    measured = profiled_causal_lm_peak(checkpointed_jamba, tokens, lambda params: torch.optim.SGD(params, lr=1e-2))
    assert abs(predicted - measured) <= 0.005 * measured, f"predicted {predicted:,} B, measured {measured:,} B"


TINY_PVT = {
    "model_type": "pvt",
    "image_size": 32,
    "num_encoder_blocks": 2,
    "depths": [1, 2],
    "sequence_reduction_ratios": [2, 1],
    "hidden_sizes": [16, 32],
    "patch_sizes": [4, 2],
    "strides": [4, 2],
    "num_attention_heads": [1, 2],
    "mlp_ratios": [2, 2],
    "num_labels": 10,
    "architectures": ["PvtForImageClassification"],
}


def test_a_list_of_lists_of_blocks_checkpoints_its_blocks(tmp_path):
    """PVT keeps one nn.ModuleList of layers per stage in a ModuleList (`pvt.encoder.block`, modeling_pvt.py): its
    `--checkpoint all` named the stages' lists, never called themselves, and was refused (a helper's hunt of
    transformers' image classifiers, 2026-12-07; PoolFormer the same). Truth: the real step with every layer (and
    every patch embedding, the other list of repeated blocks) checkpointed,
    non-reentrant, by the CPU allocator's events (oneDNN off, as hand_measure runs it)."""
    import json

    from torch.utils.checkpoint import checkpoint
    from transformers import AutoConfig, AutoModelForImageClassification

    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from tests.hand_measure import profiled_causal_lm_peak

    (tmp_path / "config.json").write_text(json.dumps(TINY_PVT))
    spec = resolve_model(str(tmp_path))
    settings = spec.settings_for(
        TrainingSettings(batch_size=2, image_size=32, device="cpu", optimizer="sgd", checkpoint="all")
    )
    with torch.backends.mkldnn.flags(enabled=False):
        traced = trace_step(spec, settings)
    stages = ["pvt.encoder.block.0.0", "pvt.encoder.block.1.0", "pvt.encoder.block.1.1"]
    assert traced.checkpointed_blocks == ["pvt.encoder.patch_embeddings.0", "pvt.encoder.patch_embeddings.1", *stages]
    predicted = simulate(traced).peak_bytes

    def model_of() -> torch.nn.Module:
        model = AutoModelForImageClassification.from_config(AutoConfig.for_model(**TINY_PVT))
        blocks = [*model.pvt.encoder.patch_embeddings, *(layer for stage in model.pvt.encoder.block for layer in stage)]
        for layer in blocks:
            layer.forward = lambda *a, forward=layer.forward, **k: checkpoint(forward, *a, use_reentrant=False, **k)
        return model

    def batch_of() -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 10, (2,))}

    measured = profiled_causal_lm_peak(model_of, batch_of, optimizer_of=torch.optim.SGD)
    assert abs(predicted - measured) <= 0.005 * measured, f"predicted {predicted:,} B, measured {measured:,} B"


# Tiny configs (a helper's hunt of transformers' image classifiers, 2026-12-07), 64 and 32 px.
_HF_CHECKPOINTED = {
    "mobilevit": (
        {
            "image_size": 64,
            "hidden_sizes": [16, 24, 32],
            "neck_hidden_sizes": [8, 8, 16, 16, 24, 32, 64],
            "num_attention_heads": 2,
            "patch_size": 2,
        },
        64,
    ),
    "swiftformer": ({"depths": [1, 1, 1, 1], "embed_dims": [8, 16, 24, 32]}, 32),
}


@pytest.mark.parametrize("model_type", list(_HF_CHECKPOINTED))
def test_checkpoint_all_is_what_hugging_face_s_gradient_checkpointing_wraps(tmp_path, model_type):
    """`--checkpoint all` on a transformers model checkpoints its GradientCheckpointingLayers, as
    `gradient_checkpointing_enable()` does: MobileViT's MobileViTLayers share a list with its MobileNet stages, where
    memplan had checkpointed the transformer layers inside them (30% below the real run), and SwiftFormer's stages
    share one with their embeddings, where it had checkpointed nothing (3.4% above). Truth: the real step with
    Hugging Face's own gradient checkpointing, by the CPU allocator's events (oneDNN off on both sides)."""
    import json

    from transformers import AutoConfig, AutoModelForImageClassification

    from memplan.estimator.simulate import simulate
    from memplan.estimator.trace import trace_step
    from tests.hand_measure import profiled_causal_lm_peak

    overrides, size = _HF_CHECKPOINTED[model_type]
    config = AutoConfig.for_model(model_type, num_labels=10, **overrides)

    def model_of() -> torch.nn.Module:
        model = AutoModelForImageClassification.from_config(config)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def batch_of() -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(2, 3, size, size), "labels": torch.randint(0, 10, (2,))}

    measured = profiled_causal_lm_peak(model_of, batch_of)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    spec = resolve_model(str(tmp_path), task="image-classification")
    settings = spec.settings_for(TrainingSettings(batch_size=2, image_size=size, device="cpu", checkpoint="all"))
    with torch.backends.mkldnn.flags(enabled=False):
        assert simulate(trace_step(spec, settings)).peak_bytes == measured


def test_a_module_of_the_user_s_holding_a_transformers_model_keeps_its_own_blocks_checkpointed():
    """Hugging Face's rule (its GradientCheckpointingLayers) is for a transformers model, peft's wrapper included; a
    module of the user's that holds one beside blocks of its own keeps every repeated block checkpointed, its own too
    (the rule had dropped them: a reviewer's find)."""
    import transformers
    from torch import nn

    from memplan.estimator.checkpointing import all_blocks_layout

    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = transformers.BertModel(config)
            self.head = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])

    bert_layers = ("bert.encoder.layer.0", "bert.encoder.layer.1")
    assert all_blocks_layout(Holder()).modules == (*bert_layers, "head.0", "head.1", "head.2")
    assert all_blocks_layout(transformers.BertForMaskedLM(config)).modules == bert_layers
