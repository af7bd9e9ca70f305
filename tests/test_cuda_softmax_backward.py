"""What CUDA's softmax backward allocates besides the gradient it returns: `Tensor tmp = grad * output;`.

The truths are request sizes the lent H100 made (torch 2.11.0+cu130; docs/validation/h100/traces-main.tar.gz,
read here from the archive) and byte counts written out from aten/src/ATen/native/cuda/SoftMax.cu
(`softmax_backward_cuda_out`: the product of the gradient and the output, in their dtype and shape;
`host_softmax_backward`: a `.contiguous()` copy of each operand that is not contiguous), not computed by memplan.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import torch
from torch import nn

from memplan.estimator.cuda.softmax_backward import (
    LOG_SOFTMAX_BACKWARD,
    SOFTMAX_BACKWARD,
    softmax_backward_requests,
)
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.module_specs import loss_returning_spec

TRACES = Path(__file__).resolve().parents[1] / "docs" / "validation" / "h100" / "traces-main.tar.gz"
PRODUCT = "aten._softmax_backward_data.default's product and copies"


def _second_request_freed_at_once(config_id: str, size: int) -> int:
    """How often the H100's trace of `config_id` allocates `size` bytes twice in a row and frees the second at
    once: a softmax backward's grad_input, then its product, freed as the op returns."""
    with tarfile.open(TRACES) as tar:
        events = json.load(tar.extractfile(f"{config_id}.json"))["events"]  # type: ignore[arg-type]
    events = [event for event in events if event[0] in ("alloc", "free_completed")]
    return sum(
        1
        for first, second, third in zip(events, events[1:], events[2:], strict=False)
        if first[0] == second[0] == "alloc"
        and first[2] == second[2] == size
        and third[0] == "free_completed"
        and third[1] == second[1]
    )


def test_the_product_is_the_size_the_h100_requested_after_each_grad_input() -> None:
    """gpt2-eager-attention: float32 scores [4, 12 heads, 1,024, 1,024] under bf16 autocast, 12 layers; the
    product is 4 x 12 x 1,024 x 1,024 x 4 = 201,326,592 B, requested right after the equal grad_input and freed
    first, once a layer. qwen2.5-0.5b-fp32's math attention: [2, 14, 2,048, 2,048] float32, 24 layers."""
    grad, output = torch.empty(4, 12, 1024, 1024), torch.empty(4, 12, 1024, 1024)
    assert softmax_backward_requests(SOFTMAX_BACKWARD, grad, output) == (4 * 12 * 1024 * 1024 * 4,)
    assert _second_request_freed_at_once("gpt2-eager-attention", 201_326_592) == 12
    grad, output = torch.empty(2, 14, 2048, 2048), torch.empty(2, 14, 2048, 2048)
    assert softmax_backward_requests(SOFTMAX_BACKWARD, grad, output) == (2 * 14 * 2048 * 2048 * 4,)
    assert _second_request_freed_at_once("qwen2.5-0.5b-fp32", 469_762_048) == 24


def test_log_softmax_backward_makes_no_product_and_operands_not_contiguous_are_copied() -> None:
    grad, output = torch.empty(64, 1000), torch.empty(64, 1000)
    assert softmax_backward_requests(LOG_SOFTMAX_BACKWARD, grad, output) == ()
    # a transposed output is copied by host_softmax_backward (`output_.contiguous()`), after the product
    strided = torch.empty(1000, 64).t()
    assert softmax_backward_requests(SOFTMAX_BACKWARD, grad, strided) == (64 * 1000 * 4, 64 * 1000 * 4)
    assert softmax_backward_requests(LOG_SOFTMAX_BACKWARD, strided, output) == (64 * 1000 * 4,)
    # the product of two transposed operands keeps their layout (TensorIterator), so it is copied too
    assert softmax_backward_requests(SOFTMAX_BACKWARD, strided, strided) == (64 * 1000 * 4,) * 3
    # an empty gradient: the product (0 bytes) and nothing else
    assert softmax_backward_requests(SOFTMAX_BACKWARD, torch.empty(0, 10), torch.empty(0, 10)) == ()


class _Scores(nn.Module):
    """A softmax over [batch, 256, 256] scores, read by a product, so autograd saves its output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x)
        return (torch.softmax(scores, dim=-1) * x).sum()


def test_the_softmax_backward_node_requests_its_product_on_cuda_only() -> None:
    spec = loss_returning_spec("softmax-scores", _Scores, (256, 256))
    settings = TrainingSettings(batch_size=4, optimizer="sgd", gpu="H100-80GB")
    simulation = simulate(trace_step(spec, settings))
    product = [a for a in simulation.timeline.allocations if a.op == PRODUCT]
    scores = 4 * 256 * 256 * 4  # float32 [4, 256, 256]: 1 MiB
    assert [a.requested_bytes or a.size_bytes for a in product] == [scores]
    # while the node runs: its incoming gradient, the saved output, grad_input and the product, each 1 MiB
    assert simulation.timeline_bytes[product[0].allocated_at] >= 4 * scores
    assert product[0].freed_at == product[0].allocated_at
    cpu = simulate(trace_step(spec, settings.replace(device="cpu", gpu=None)))
    assert not [a for a in cpu.timeline.allocations if a.op == PRODUCT]
