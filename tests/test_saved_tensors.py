"""memplan.estimator.saved_tensors: a tensor autograd saves lives until its Node has run, read or not.

Truth: the same step run for real on the CPU (memplan.measure.cpu counts every storage until a weakref finalizer
reports it freed)."""

from __future__ import annotations

import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings


class Spectral(nn.Module):
    """rfft's Node (FftR2CBackward0) saves its input and reads only its size: no op of the backward reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(129, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.fft.rfft(self.up(x), dim=-1).abs())


def spectral() -> nn.Module:
    return Spectral()


def rows(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16, 64)


def mean_square(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output.square().mean()


def test_a_saved_tensor_no_op_of_the_backward_reads_lives_until_its_node_runs():
    """The [8, 16, 256] float32 input of rfft (128 KiB) is held by the graph into the backward: it had been freed
    at its last use in the forward, 14.6% low."""
    spec = resolve_model(
        "tests.test_saved_tensors:spectral",
        inputs="tests.test_saved_tensors:rows",
        loss="tests.test_saved_tensors:mean_square",
    )
    settings = spec.settings_for(TrainingSettings(batch_size=8, device="cpu", optimizer="sgd"))
    predicted = simulate(trace_step(spec, settings)).peak_bytes
    assert abs(predicted - measure_cpu(spec, settings).peak_bytes) <= 8


def test_a_saved_parameter_holds_no_storage_it_no_longer_has():
    """autograd keeps a saved parameter itself, not the storage it had when saved: DeepSpeed's ZeRO-3 swaps a
    layer's gathered weights out of the parameter after its forward (`param.data = empty`), and torch frees them
    though the graph lives. Noting the storage the parameter had kept every layer's gathered weights to the
    backward (+12 GiB on a llama-3-8b ZeRO-3 rank, docs/walkthroughs.md)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from memplan.estimator.saved_tensors import SavedTensors

    weight = nn.Parameter(torch.randn(256, 256))
    graphs = SavedTensors(lambda: 7)
    with graphs:
        output = torch.randn(4, 256, requires_grad=True) @ weight  # MmBackward0 saves both
    gathered = StorageWeakRef(weight.untyped_storage())
    weight.data = torch.empty(0)  # as ZeRO-3 releases a parameter after its module's forward
    assert gathered.expired() and output.grad_fn is not None  # torch freed it, the graph still alive
    assert gathered not in dict(graphs.lifetimes(step_end=9))
