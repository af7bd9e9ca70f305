"""memplan.estimator.trace: what the traced iteration starts with is what a real one finds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.errors import SettingsError
from tests.hand_measure import measured_step_peak


class WithUnusedHead(nn.Module):
    """A head the loss never reaches (an auxiliary head, a pooler the task does not use): trainable, never graded."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.unused_head = nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).square().mean()


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 64)


@pytest.mark.parametrize(
    ("optimizer", "make"),
    [
        ("adamw", lambda params: torch.optim.AdamW(params)),
        ("sgd-momentum", lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)),
    ],
)
def test_parameters_no_gradient_reaches_get_no_optimizer_state(optimizer, make):
    """torch's optimizers skip a parameter whose .grad is None: measured on the real step, the head has none."""
    predicted = memplan.estimate(WithUnusedHead(), inputs=rows, batch_size=32, device="cpu", optimizer=optimizer)
    model = WithUnusedHead()

    def step(model, batch, optimizer):
        model(batch["x"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    measured = measured_step_peak(step, model, {"x": rows(32)}, make(model.parameters()))
    assert predicted.peak_bytes == pytest.approx(measured, rel=0, abs=16)  # torch.optim may keep a scalar or two


def _accumulating(model, batch, optimizer):
    for _ in range(2):
        (model(batch["x"]) / 2).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _zero_grad_before_backward(model, batch, optimizer):
    loss = model(batch["x"])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize(
    ("settings", "step"),
    [({"grad_accum": 2}, _accumulating), ({"loop": "zero-grad-before-backward"}, _zero_grad_before_backward)],
)
def test_a_loop_that_keeps_gradients_keeps_none_for_parameters_no_gradient_reaches(settings, step):
    """Where gradients outlive a micro-batch the traced one started with a gradient for every trainable parameter,
    the head's too, and AdamW state for it (1,016,584 B too many here)."""
    predicted = memplan.estimate(WithUnusedHead(), inputs=rows, batch_size=32, device="cpu", **settings)
    model = WithUnusedHead()
    measured = measured_step_peak(step, model, {"x": rows(32)}, torch.optim.AdamW(model.parameters()))
    assert predicted.peak_bytes == pytest.approx(measured, rel=0, abs=16)


class SparseEmbeddingBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(1000, 16, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).square().mean()


def test_a_sparse_embedding_is_refused_in_one_line():
    """Its gradient is a sparse COO tensor with no storage of its own: torch's "Cannot access storage of
    SparseTensorImpl" had come out blamed on the loss or optimizer."""
    ids = lambda batch_size: torch.randint(0, 1000, (batch_size, 4))  # noqa: E731
    with pytest.raises(SettingsError, match=r"module table makes sparse gradients \(EmbeddingBag\(sparse=True\)\)"):
        memplan.estimate(SparseEmbeddingBag(), inputs=ids, batch_size=8, device="cpu", optimizer="sgd")


class FunctionalSparseEmbedding(nn.Module):
    """F.embedding / F.embedding_bag with sparse=True on a bare parameter: no nn.Embedding module to refuse."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.table, self.bag = nn.Parameter(torch.randn(1000, 16)), bag

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.bag:
            return F.embedding_bag(ids, self.table, sparse=True).square().mean()
        return F.embedding(ids, self.table, sparse=True).square().mean()


class SparseAdjacency(nn.Module):
    """A graph convolution over a sparse COO adjacency buffer (torch.sparse.mm)."""

    def __init__(self) -> None:
        super().__init__()
        ring = torch.stack([torch.arange(8), (torch.arange(8) + 1) % 8])
        self.register_buffer("adjacency", torch.sparse_coo_tensor(ring, torch.ones(8), (8, 8)).coalesce())
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adjacency, self.linear(x)).square().mean()


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding_bag"])
def test_a_functional_sparse_embedding_is_refused_as_a_sparse_gradient(bag):
    """Before: "cannot trace ... in the backward pass: NotImplementedError: Cannot access storage of
    SparseTensorImpl"."""
    ids = lambda batch_size: torch.randint(0, 1000, (batch_size, 4))  # noqa: E731
    with pytest.raises(SettingsError, match=r"in the backward pass makes a sparse gradient \(F\.embedding") as refused:
        memplan.estimate(FunctionalSparseEmbedding(bag), inputs=ids, batch_size=8, device="cpu", optimizer="sgd")
    assert "SparseTensorImpl" not in str(refused.value)


def adjacency_nodes(batch_size: int) -> torch.Tensor:
    return torch.randn(8, 4)


def test_a_sparse_buffer_is_refused_as_a_sparse_tensor_not_blamed_on_the_batch():
    """Before, from a factory: "... NotImplementedError: Cannot access storage of SparseTensorImpl; check that the
    batch from --inputs ... is what it takes" (autograd's saved-tensor hook read the adjacency's storage). Refused
    once built, by name, as a model object's is."""
    with pytest.raises(SettingsError, match=r"adjacency is a sparse tensor \(torch\.sparse_coo\)") as refused:
        memplan.estimate(
            "tests.test_trace:SparseAdjacency", inputs="tests.test_trace:adjacency_nodes", batch_size=8, device="cpu"
        )
    assert "batch" not in str(refused.value)


class UnreadSparseAdjacency(SparseAdjacency):
    """The sparse buffer held but never read by the step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).square().mean()


def test_a_factory_s_unread_sparse_buffer_is_refused_not_an_internal_error():
    """Before: "memplan: internal error: SparseTensorRefused: None takes a torch.sparse_coo tensor" (the trace passed;
    sorting the model's storages afterwards raised outside the trace's error handling)."""
    with pytest.raises(SettingsError, match=r"adjacency is a sparse tensor \(torch\.sparse_coo\)"):
        memplan.estimate(
            "tests.test_trace:UnreadSparseAdjacency",
            inputs="tests.test_trace:adjacency_nodes",
            batch_size=8,
            device="cpu",
            optimizer="sgd",
        )


def test_a_model_objects_sparse_buffer_is_refused_not_estimated_dense():
    """Before, the object's copy (memplan.models.objects.skeleton) made the sparse adjacency a dense [8, 8] tensor and
    estimated that model silently: a real graph's [n, n] dense adjacency is n² × 4 bytes its run never holds."""
    with pytest.raises(SettingsError, match=r"adjacency is a sparse tensor \(torch\.sparse_coo\)"):
        memplan.estimate(SparseAdjacency(), inputs=adjacency_nodes, batch_size=8, device="cpu", optimizer="sgd")


ROWS, WIDTH, LENGTH = 1024, 256, 64


class CastsItsTable(nn.Module):
    """A table of positions kept as a float32 buffer and bound again, on the first forward, to its copy in the hidden
    states' dtype: as wav2vec2-conformer's relative positions do (`self.pe = self.extend_pe(hidden_states, self.pe)`,
    transformers' modeling_wav2vec2_conformer.py), bfloat16 under autocast, the float32 table let go."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.table = nn.Buffer(torch.randn(ROWS, WIDTH), persistent=False)  # 1 MiB in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.proj(x)
        if self.table.dtype != hidden.dtype:
            self.table = self.table.to(hidden.dtype)
        return (hidden + self.table[: x.shape[1]]).float().square().mean()


def positions(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, LENGTH, WIDTH)


def test_a_buffer_the_first_forward_casts_is_held_only_in_its_cast_dtype_as_in_the_real_run():
    """The first trace of a setup held both tables (the float32 one read as a constant of the whole step): 1 MiB too
    many here, wav2vec2-conformer's amp-bf16 steps 2.7% high (tests/test_models_speech.py). The real run's third
    iteration, by the CPU allocator's events, holds the bfloat16 table only."""
    from tests.hand_measure import profiled_third_iteration_peak, training_iteration

    predicted = memplan.estimate(CastsItsTable(), inputs=positions, batch_size=4, device="cpu", precision="amp-bf16")

    def build():
        torch.manual_seed(0)
        model = CastsItsTable()
        optimizer = torch.optim.AdamW(model.parameters())
        batch = positions(4)
        build.kept = (model, optimizer, batch)

        def loss_under_autocast(inputs: torch.Tensor) -> torch.Tensor:  # (the model returns its loss)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(inputs)

        return training_iteration(loss_under_autocast, batch, lambda loss, _: loss, optimizer)

    measured = profiled_third_iteration_peak(build)
    assert predicted.peak_bytes == pytest.approx(measured, rel=0, abs=16), (predicted.peak_bytes, measured)
