"""What CUDA's dense embedding backward sorts and sums in besides the gradient it returns.

The truths are request sizes the lent H100 made (torch 2.11.0+cu130; docs/validation/h100/traces-main.tar.gz,
read here from the archive) and byte counts written out from the shapes of EmbeddingBackwardKernel.cu
(`embedding_backward_cuda_kernel`), not computed by memplan.
"""

from __future__ import annotations

import collections
import json
import tarfile
from pathlib import Path

import torch
from torch import nn

from memplan.estimator.cuda.embedding_backward import REQUEST_SLOTS, embedding_backward_call
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.settings import TrainingSettings
from tests.module_specs import loss_returning_spec


def _requests(*args, **kwargs) -> tuple[int, ...]:
    return embedding_backward_call(*args, **kwargs).requests()


TRACES = Path(__file__).resolve().parents[1] / "docs" / "validation" / "h100" / "traces-main.tar.gz"
H100_SMS = 132
SCRATCH = "embedding backward's sort and partial sums"


def _measured_requests(config_id: str) -> collections.Counter:
    with tarfile.open(TRACES) as tar:
        events = json.load(tar.extractfile(f"{config_id}.json"))["events"]  # type: ignore[arg-type]
    return collections.Counter(size for action, _, size, _ in events if action == "alloc")


def test_gpt2_token_embedding_backward_requests_what_the_h100_requested() -> None:
    """gpt2-bf16: 16 x 1,024 int64 indices, 768 bfloat16 features, 50,257 rows. The H100's trace of that
    backward, in order: sorted and orig indices, range, cub's sort storage (freed), the output, segment_offsets,
    num_of_segments, cub's unique-by-key keys and storage (freed), partials_per_segment, its offsets, cub's
    scan storage (freed), num_of_partial_segments, partial_segment_offset, grad_weight_per_segment."""
    tokens = 16 * 1024
    max_partial_segment = tokens // 10 + min(tokens, 50257)  # 18,022
    expected = (
        tokens * 8,  # sorted_indices
        tokens * 8,  # orig_indices
        tokens * 8,  # segment_offsets
        8,  # num_of_segments_tensor
        tokens * 8,  # partials_per_segment
        tokens * 8,  # partials_per_segment_offset
        8,  # num_of_partial_segments_tensor
        max_partial_segment * 8,  # partial_segment_offset: 144,176
        max_partial_segment * 768 * 4,  # grad_weight_per_segment in float32: 55,363,584
    )
    grad = torch.empty(16, 1024, 768, dtype=torch.bfloat16)
    indices = torch.empty(16, 1024, dtype=torch.long)
    assert _requests(grad, indices, 50257, False, H100_SMS) == expected
    measured = _measured_requests("gpt2-bf16")
    assert measured[55_363_584] == 1 and measured[144_176] == 1 and measured[131_072] >= 5


def test_a_two_row_embedding_takes_the_fused_path_as_bert_large_did_on_the_h100() -> None:
    """bert-large-amp-bf16: 16 x 512 token types into 2 rows of 1,024 float32 features. sum_and_scatter would
    launch 2 blocks (< 4 per multiprocessor) over 821 partial segments, so the fused atomic kernel runs:
    partial_to_segment_idx instead of per-segment rows (two 821 x 8 = 6,568 B arrays in the H100's trace)."""
    tokens = 16 * 512
    partial = tokens // 10 + 2
    grad = torch.empty(16, 512, 1024)
    indices = torch.empty(16, 512, dtype=torch.long)
    expected = (tokens * 8, tokens * 8, tokens * 8, 8, 2 * 8, 2 * 8, 8, partial * 8, partial * 8)
    assert _requests(grad, indices, 2, False, H100_SMS) == expected
    assert _measured_requests("bert-large-amp-bf16")[6_568] == 2
    # bfloat16 gradients accumulate in a float32 copy of the whole table; deterministic runs take two passes.
    assert _requests(grad.bfloat16(), indices, 2, False, H100_SMS)[-1] == 2 * 1024 * 4
    assert _requests(grad, indices, 2, False, H100_SMS, deterministic=True)[-1] == partial * 1024 * 4


def test_few_indices_run_the_feature_kernel_without_scratch() -> None:
    grad = torch.empty(3072, 64)
    assert _requests(grad, torch.empty(3072, dtype=torch.long), 100, False, H100_SMS) == ()
    # scale_grad_by_freq sorts whatever the count, with a count array like the indices (int32 here: 4 B each).
    small = _requests(torch.empty(8, 64), torch.empty(8, dtype=torch.int32), 100, True, H100_SMS)
    assert small[:3] == (8 * 4, 8 * 4, 8 * 4)
    # A gradient that is not contiguous is copied first, on either path.
    strided = torch.empty(64, 3000).t()
    assert _requests(strided, torch.empty(3000, dtype=torch.long), 100, False, H100_SMS) == (3000 * 64 * 4,)


class _TokenModel(nn.Module):
    """Token ids made from a float batch of [4096] per sample, embedded in 1,000 rows of 64 features."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(1000, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 1000).long().clamp(max=999)
        return self.embedding(ids).square().sum()


def test_the_embedding_backward_node_requests_its_scratch_on_cuda_only() -> None:
    spec = loss_returning_spec("token-embedding", _TokenModel, (4096,))
    settings = TrainingSettings(batch_size=2, optimizer="sgd", gpu="H100-80GB")
    simulation = simulate(trace_step(spec, settings))
    scratch = [a for a in simulation.timeline.allocations if a.op == SCRATCH and a.size_bytes]
    tokens = 2 * 4096
    partial = tokens // 10 + 1000  # min(8,192 tokens, 1,000 rows) segments at most
    # sorted, orig, segment_offsets; two 8-byte counters; two [1,000] arrays; partial offsets; float32 partial rows
    expected = [tokens * 8] * 3 + [8, 1000 * 8, 1000 * 8, 8, partial * 8, partial * 64 * 4]
    assert sorted(a.requested_bytes or a.size_bytes for a in scratch) == sorted(expected)
    assert len({a.allocated_at for a in scratch}) == 1
    # While the node runs, live memory holds the weight, the incoming gradient, the outgoing one and the scratch
    # in 512-byte blocks (the partial rows: 1,819 x 256 B = 465,664 B, 466,432 B in blocks).
    rounded = [-(-size // 512) * 512 for size in expected]
    weight = grad_weight = 1000 * 64 * 4
    incoming = tokens * 64 * 4
    assert simulation.timeline_bytes[scratch[0].allocated_at] >= weight + incoming + grad_weight + sum(rounded)
    cpu = simulate(trace_step(spec, settings.replace(device="cpu", gpu=None)))
    assert not [a for a in cpu.timeline.allocations if a.op == SCRATCH]
    # every call holds the same parts at any size (0 bytes where its path makes no such request): lines through
    # batch sizes on either side of the 3,072-index switch size them anew (memplan.estimator.interpolate)
    parts = [a for a in simulation.timeline.allocations if a.op == SCRATCH]
    assert len(parts) == REQUEST_SLOTS and len(scratch) == len(expected)


def test_the_fullest_path_holds_as_many_requests_as_every_call_keeps_parts() -> None:
    """Both copies, the count (scale_grad_by_freq) and the fused path's two extra arrays for a 16-bit gradient:
    2 + 2 sorted/original + 1 + 6 index arrays + 2 = 13 requests; every other path holds fewer."""
    tokens = 8192
    indices = torch.empty(tokens, 2, dtype=torch.long)[:, 0]  # strided: copied
    grad = torch.empty(64, tokens, dtype=torch.bfloat16).t()  # strided: copied
    fullest = embedding_backward_call(grad, indices, 2, True, H100_SMS).requests()  # 2 rows: the fused path
    assert len(fullest) == REQUEST_SLOTS == 13
    plain = embedding_backward_call(grad.contiguous(), indices.contiguous(), 50_000, False, H100_SMS).requests()
    assert 0 < len(plain) < REQUEST_SLOTS
