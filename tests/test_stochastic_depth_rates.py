"""A model factory that reads back tensors it makes of constants: stochastic-depth rates as timm
(`calculate_drop_path_rates`, timm/layers/drop.py) and the official Swin, ConvNeXt and DeiT code make them,
`torch.linspace(0, drop_path_rate, depth)` read with `.item()` or `.tolist()`, a `DropPath` where a block's rate is
above 0 and an `nn.Identity` where it is 0. Under memplan's fake tensors `.item()` answered a constant 2.0 for every
rate, so the traced model had a DropPath (its mask and product) in every block, the real one in none: timm's Swin with
its first stage's rate 0 and the blocks checkpointed was predicted +0.50% (+3.8% with one stage). Truth: the same
step run plainly, measured by the CPU allocator's events."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import build_fake_setup, trace_step
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak, training_iteration
from tests.module_specs import loss_returning_spec

WIDTH, TOKENS, DEPTH = 32, 64, 3


class _DropPath(nn.Module):
    """timm's DropPath (timm/layers/drop.py, drop_path): one kept-or-dropped factor per sample."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 1 - self.rate
        mask = x.new_empty((x.shape[0], 1, 1)).bernoulli_(keep)
        if keep > 0.0:
            mask.div_(keep)
        return x * mask


class _Block(nn.Module):
    def __init__(self, rate: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop_path = _DropPath(rate) if rate > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


class _Stack(nn.Module):
    """Blocks checkpointed by the model itself (timm's `set_grad_checkpointing`), rates read as `read` says."""

    def __init__(self, drop_path_rate: float, read: str) -> None:
        super().__init__()
        rates = torch.linspace(0, drop_path_rate, DEPTH)
        values = rates.tolist() if read == "tolist" else [rate.item() for rate in rates]
        self.blocks = nn.ModuleList(_Block(rate) for rate in values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.square().mean()


@pytest.mark.parametrize("read", ["item", "tolist"])
@pytest.mark.parametrize("drop_path_rate", [0.0, 0.1])
def test_a_factory_reads_the_rates_it_made_as_the_real_one_does(drop_path_rate, read):
    settings = TrainingSettings(batch_size=2, device="cpu", optimizer="sgd")
    spec = loss_returning_spec("stochastic-depth", lambda: _Stack(drop_path_rate, read), (TOKENS, WIDTH))
    built = build_fake_setup(spec, settings).state.model
    real = _Stack(drop_path_rate, read)
    assert [type(block.drop_path) for block in built.blocks] == [type(block.drop_path) for block in real.blocks]
    assert [getattr(block.drop_path, "rate", 0.0) for block in built.blocks] == pytest.approx(
        [getattr(block.drop_path, "rate", 0.0) for block in real.blocks]
    )


@pytest.mark.parametrize("drop_path_rate", [0.0, 0.1])
def test_a_step_whose_blocks_have_no_drop_path_where_their_rate_is_0(drop_path_rate):
    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = _Stack(drop_path_rate, "item")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(2, TOKENS, WIDTH)
        build.kept = (model, optimizer, batch)
        return training_iteration(model, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)
    spec = loss_returning_spec("stochastic-depth", lambda: _Stack(drop_path_rate, "item"), (TOKENS, WIDTH))
    settings = TrainingSettings(batch_size=2, device="cpu", optimizer="sgd")
    assert simulate(trace_step(spec, settings)).peak_bytes == measured


def test_a_value_read_from_no_constant_is_still_the_constant():
    """A tensor not made of constants alone (random, uninitialized) has no value to replay: `.item()` answers the
    constant it always has while a model is built."""

    class _Random(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen = (torch.rand(()).item(), torch.linspace(0, 1, 3)[1].item())
            self.fc = nn.Linear(WIDTH, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).mean()

    spec = loss_returning_spec("random-item", _Random, (WIDTH,))
    built = build_fake_setup(spec, TrainingSettings(batch_size=2, device="cpu", optimizer="sgd")).state.model
    assert built.seen == (2.0, 0.5)


def test_a_value_an_initialiser_wrote_is_not_read_back_as_before_it():
    """memplan skips torch.nn.init's initialisers while building (hf_patches.no_weight_init); a tensor one wrote is
    no longer what its constants made: `torch.zeros(1)` after `uniform_(0.5, 1.0)` had read back 0.0, a value the real
    factory never sees; it reads as the constant again. A large `.tolist()` is read with one replay (it had replayed
    the whole chain once per element: 200x200 values took over five minutes)."""

    class _Initialised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            scale = torch.zeros(1)
            nn.init.uniform_(scale, 0.5, 1.0)
            grid = (torch.arange(40_000).float() / 7).reshape(200, 200)
            self.seen = (scale.item(), grid.tolist()[-1][-1])
            self.fc = nn.Linear(WIDTH, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).mean()

    spec = loss_returning_spec("initialised-item", _Initialised, (WIDTH,))
    built = build_fake_setup(spec, TrainingSettings(batch_size=2, device="cpu", optimizer="sgd")).state.model
    assert built.seen == (2.0, (torch.tensor(39_999.0) / 7).item())  # float32, as the real factory reads it
