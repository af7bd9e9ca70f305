"""Tensors a GPU run keeps in host memory stay out of the cuda target's device figures
(memplan.estimator.cuda.host_tensors).

The expected device bytes are counted here from what torch itself makes: the real optimizer stepped
over parameters on the meta device (which stands for the GPU: a state tensor torch puts on the
parameter's device lands there, one it makes with `torch.tensor(...)` lands on the CPU), each
rounded up to the caching allocator's 512-byte blocks (CUDACachingAllocator.cpp kMinBlockSize).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memplan
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings
from tests.two_layer_mlp import two_layer

MLP = "tests.two_layer_mlp:two_layer"
ROWS = "tests.two_layer_mlp:rows"
LOSS = "tests.two_layer_mlp:mean_square"


def _blocks(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


def _state_bytes_by_device(optimizer_class: type[torch.optim.Optimizer], **options: object) -> dict[str, int]:
    """What the real optimizer's state holds after a step over the two-layer model on the meta device:
    512-byte blocks of the GPU's ("meta") tensors, plain bytes of the host's ("cpu")."""
    model = two_layer().to("meta")
    for param in model.parameters():
        param.grad = torch.empty_like(param)
    optimizer = optimizer_class(model.parameters(), **options)
    try:
        optimizer.step()
    except RuntimeError:  # Adafactor reads a norm's value (.item()), which meta tensors lack: its state exists by then
        pass
    totals = {"meta": 0, "cpu": 0}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                kind = value.device.type
                totals[kind] += _blocks(value.nbytes) if kind == "meta" else value.nbytes
    return totals


@pytest.mark.parametrize(
    ("optimizer", "optimizer_class", "options"),
    [
        ("adamw", torch.optim.AdamW, {"foreach": True}),
        ("adafactor", torch.optim.Adafactor, {"foreach": True}),
    ],
)
def test_optimizer_step_counters_are_host_memory(
    optimizer: str, optimizer_class: type[torch.optim.Optimizer], options: dict
) -> None:
    """AdamW's and Adafactor's `state["step"]` are host tensors on a GPU run (adam.py, _adafactor.py
    `_init_group`): the device's optimizer state is the rest."""
    expected = _state_bytes_by_device(optimizer_class, **options)
    assert expected["cpu"] > 0  # the counters are there to leave out
    result = memplan.estimate(MLP, inputs=ROWS, loss=LOSS, device="cuda", optimizer=optimizer, batch_size=4)
    assert result.breakdown.optimizer_state == expected["meta"]


def test_fused_step_counters_stay_on_the_gpu() -> None:
    """fused=True makes the counters on the parameter's device (adam.py `_init_group`)."""
    result = memplan.estimate(
        MLP, inputs=ROWS, loss=LOSS, device="cuda", optimizer="adamw", optimizer_impl="fused", batch_size=4
    )
    model = two_layer()
    expected = sum(
        2 * _blocks(param.nbytes) + _blocks(torch.empty((), dtype=torch.float32).nbytes) for param in model.parameters()
    )
    assert result.breakdown.optimizer_state == expected


class _Attention(nn.Module):
    """One self-attention in float32, which runs the memory-efficient kernel on an H100."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.qkv = nn.Linear(64, 3 * 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 32).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout)
        return out.square().mean()


def attention_with_dropout() -> nn.Module:
    return _Attention(0.1)


def attention_without_dropout() -> nn.Module:
    return _Attention(0.0)


def tokens(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16, 64)


@pytest.mark.parametrize(("model", "on_host"), [("attention_with_dropout", True), ("attention_without_dropout", False)])
def test_efficient_attention_philox_seed_and_offset(model: str, on_host: bool) -> None:
    """attention.cu `_efficient_attention_forward` (under `_scaled_dot_product_efficient_attention`) returns the
    output, its logsumexp and the philox seed and offset: with dropout the two are CPU scalars
    (`at::scalar_tensor(..., at::dtype(at::kLong))`), without it `at::empty({}, ...device(device))` on the GPU,
    whose 8-byte requests the device's timeline then has."""
    spec = resolve_model(f"tests.test_cuda_host_tensors:{model}", inputs="tests.test_cuda_host_tensors:tokens")
    settings = spec.settings_for(TrainingSettings(batch_size=2, device="cuda", gpu="H100-80GB", optimizer="none"))
    timeline = simulate(trace_step(spec, settings)).timeline
    made = [
        a.requested_bytes
        for a in timeline.allocations
        if a.op == "aten._scaled_dot_product_efficient_attention.default"
    ]
    scalars = [nbytes for nbytes in made if nbytes == torch.empty((), dtype=torch.int64).nbytes]
    assert len(made) == (2 if on_host else 4)
    assert scalars == ([] if on_host else [8, 8])


def plain_step(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """A --step of the canonical loop's kind."""
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_a_custom_step_s_step_counters_are_host_memory_too() -> None:
    expected = _state_bytes_by_device(torch.optim.AdamW, foreach=True)
    result = memplan.estimate(
        MLP, inputs=ROWS, device="cuda", optimizer="adamw", batch_size=4, step="tests.test_cuda_host_tensors:plain_step"
    )
    assert result.breakdown.optimizer_state == expected["meta"]


@pytest.mark.parametrize(
    "options",
    [{"lr": torch.tensor(1e-3), "foreach": False}, {"lr": 1e-3, "betas": (torch.tensor(0.9), torch.tensor(0.999))}],
    ids=["tensor-lr", "tensor-betas"],
)
def test_tensor_options_keep_the_step_counters_on_the_host(options: dict) -> None:
    """A tensor learning rate (or betas) leaves the counters where capturable and fused put them (adam.py
    `_init_group`): the host's, as torch's own AdamW over meta parameters makes them (they had been counted on the
    GPU: the probe skipped groups with a tensor option)."""
    from memplan.estimator.cuda.host_tensors import host_state_keys

    param = nn.Parameter(torch.empty(3, device="meta"))
    param.grad = torch.empty_like(param)
    optimizer = torch.optim.AdamW([param], **options)
    optimizer.step()
    expected = {name for name, value in optimizer.state[param].items() if value.device.type == "cpu"}
    assert expected == {"step"}
    assert host_state_keys(torch.optim.AdamW, optimizer.param_groups[0]) == expected
