"""Optimizer state bytes against the optimizer itself: the test builds each torch.optim optimizer
as a user would, takes one real step, and counts the bytes of the real `optimizer.state`
(memplan's optimizer construction and loop are on neither side). 8-bit Adam is bitsandbytes' own
`bnb.optim.Adam8bit` (its CPU backend runs the step), which memplan lays out without importing."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.zoo_models import odd_vocab_lm, token_inputs

USER_OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "adam8bit": lambda params: bnb.optim.Adam8bit(params, lr=1e-3),
    # On the CPU bitsandbytes pages nothing (Optimizer8bit.get_state_buffer falls back to zeros_like).
    "paged-adam8bit": lambda params: bnb.optim.PagedAdamW8bit(params, lr=1e-3),
}


def _real_state_bytes(name: str) -> int:
    torch.manual_seed(0)
    model = odd_vocab_lm()  # parameters that are not whole 256-element blocks: 8-bit Adam's partial block
    optimizer = USER_OPTIMIZERS[name](model.parameters())
    model(**token_inputs(4))["loss"].backward()
    optimizer.step()
    storages = {  # by storage: bitsandbytes shares its two quantization maps between parameters
        value.untyped_storage().data_ptr(): value.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    }
    return sum(storages.values())


def _predicted_state_bytes(name: str) -> int:
    spec = resolve_model("tests.zoo_models:odd_vocab_lm", inputs="tests.zoo_models:token_inputs")
    traced = trace_step(spec, TrainingSettings(batch_size=4, device="cpu", optimizer=name))
    return sum(
        traced.storage_bytes[key]
        for key, category in traced.storage_categories.items()
        if category == "optimizer_state"
    )


@pytest.mark.parametrize("name", sorted(USER_OPTIMIZERS))
def test_optimizer_state_bytes_are_the_real_optimizers(name):
    real = _real_state_bytes(name)
    assert _predicted_state_bytes(name) == real
    if name == "sgd":
        assert real == 0  # plain SGD keeps no state: the case that tells a missing buffer apart
    else:
        assert real > 0


def test_eight_bit_adam_keeps_bitsandbytes_blockwise_layout():
    """Optimizer2State.init_state, counted by hand for a parameter each side of min_8bit_size
    (4096 elements): 4097 elements keep two uint8 states and two float32 absmax vectors of
    ceil(4097 / 256) = 17 blocks; 4095 keep two float32 states; the two 256-entry float32
    quantization maps are stored once."""
    big, small = torch.nn.Parameter(torch.randn(4097)), torch.nn.Parameter(torch.randn(4095))
    optimizer = bnb.optim.Adam8bit([big, small], lr=1e-3)
    (big.sum() + small.sum()).backward()
    optimizer.step()
    storages = {
        value.untyped_storage().data_ptr(): value.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    }
    assert sum(storages.values()) == 2 * 4097 + 2 * 17 * 4 + 2 * 4095 * 4 + 2 * 256 * 4


@pytest.mark.parametrize(
    ("optimizer", "impl", "device", "expected"),
    [
        # torch.optim's _default_to_fused_or_foreach: foreach when every parameter is on CUDA, the
        # for-loop elsewhere; fused only when asked. memplan passes CUDA's choice explicitly (its
        # traced parameters are CPU tensors) and leaves the CPU's to torch.
        ("adamw", "default", "cuda", {"foreach": True, "fused": None}),
        ("adamw", "default", "cpu", {"foreach": None, "fused": None}),
        ("adam", "foreach", "cpu", {"foreach": True, "fused": None}),
        ("sgd-momentum", "for-loop", "cuda", {"foreach": False, "fused": None}),
        ("adamw", "fused", "cpu", {"foreach": None, "fused": True}),
        ("adafactor", "default", "cuda", {"foreach": True}),
        ("sgd", "default", "cuda", {"foreach": True, "fused": None}),
    ],
)
def test_the_implementation_is_the_one_torch_picks_on_the_target(optimizer, impl, device, expected):
    from memplan.estimator.optimizers import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(4))]
    built = build_optimizer(params, TrainingSettings(device=device, optimizer=optimizer, optimizer_impl=impl))
    assert {key: built.defaults.get(key) for key in expected} == expected
    assert (
        type(built).__name__
        == {
            "adamw": "AdamW",
            "adam": "Adam",
            "sgd": "SGD",
            "sgd-momentum": "SGD",
            "adafactor": "Adafactor",
        }[optimizer]
    )
    if optimizer == "sgd-momentum":
        assert built.defaults["momentum"] > 0


def test_no_optimizer_or_nothing_to_train_builds_none_and_8_bit_adam_takes_no_torch_flags():
    from memplan.estimator.adam8bit import Adam8bitLayout
    from memplan.estimator.optimizers import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(4))]
    assert build_optimizer(params, TrainingSettings(optimizer="none")) is None
    assert build_optimizer([], TrainingSettings(optimizer="adamw")) is None
    eight_bit = build_optimizer(params, TrainingSettings(optimizer="adam8bit", device="cuda"))
    assert isinstance(eight_bit, Adam8bitLayout) and "foreach" not in eight_bit.defaults


def test_eight_bit_adam_keeps_float32_statistics_for_16_bit_weights():
    """bitsandbytes keeps small parameters' states and every block's absmax in float32 whatever the
    weights' dtype: bfloat16 weights, counted on bnb's Adam8bit after a real step."""
    torch.manual_seed(0)
    model = odd_vocab_lm().to(torch.bfloat16)
    optimizer = bnb.optim.Adam8bit(model.parameters(), lr=1e-3)
    model(**token_inputs(4))["loss"].backward()
    optimizer.step()
    real = sum(
        {
            value.untyped_storage().data_ptr(): value.untyped_storage().nbytes()
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        }.values()
    )
    spec = resolve_model("tests.zoo_models:odd_vocab_lm", inputs="tests.zoo_models:token_inputs")
    traced = trace_step(spec, TrainingSettings(batch_size=4, device="cpu", optimizer="adam8bit", precision="bf16"))
    predicted = sum(
        traced.storage_bytes[key]
        for key, category in traced.storage_categories.items()
        if category == "optimizer_state"
    )
    assert predicted == real


class _PagingBoundary(torch.nn.Module):
    """One parameter of exactly 100,000 elements (paged) and one of 99,999 (not)."""

    def __init__(self) -> None:
        super().__init__()
        self.paged = torch.nn.Parameter(torch.zeros(100_000))
        self.kept = torch.nn.Parameter(torch.zeros(99_999))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.paged.sum() + self.kept.sum())


def test_the_paged_optimizer_keeps_large_parameters_moments_outside_torchs_allocator():
    """bitsandbytes' get_state_buffer pages the uint8 moments of parameters of 100,000 elements or
    more on CUDA (`p.numel() < 1e5` keeps an ordinary tensor): 100,000 is paged, 99,999 is not."""
    import memplan

    def run(optimizer: str) -> memplan.EstimateResult:
        return memplan.estimate(
            _PagingBoundary(),
            inputs=lambda batch: torch.randn(batch, 8),
            loss=lambda out, _: out.sum(),
            batch_size=4,
            optimizer=optimizer,
        )

    paged, plain = run("paged-adam8bit"), run("adam8bit")
    assert paged.paged_optimizer_bytes == 2 * 100_000
    # On CUDA each of the two moments was a request that memory_allocated rounds up to 512 bytes.
    assert plain.breakdown.optimizer_state - paged.breakdown.optimizer_state == 2 * 100_352
    assert any("unified memory" in note for note in paged.notes)
