"""Predictions against what the lent H100 measured (docs/validation/h100-main.json, `measured_*`
fields: torch.cuda.max_memory_reserved() of the step after two warm-ups, torch 2.11.0+cu130).

The truth here is the GPU's reading, not memplan: each case is a configuration whose miss was
studied and whose cause is now modelled, kept so that the cause cannot come back unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path

import memplan
from memplan.validate.suite import suite_named

MEASURED = Path(__file__).resolve().parents[1] / "docs" / "validation" / "h100-main.json"


def _measured(config_id: str) -> dict:
    return next(entry for entry in json.loads(MEASURED.read_text())["configs"] if entry["id"] == config_id)


def test_gpt2_bf16_reserved_and_allocated_are_what_the_h100_measured() -> None:
    """gpt2, batch 16, seq 1024, bf16 weights, AdamW: the H100 reserved 22.45 GiB in four 3,142 MiB
    logits segments and the rest. memplan said 19.33 GiB (-13.9%) while it allocated the cuBLAS
    workspaces before the first iteration; made at their threads' first matmuls, the backward's
    lands in a cached logits segment, as the run's segment list shows (73.6 + 32 MiB live in one)."""
    config = next(config for config in suite_named("main") if config.id == "gpt2-bf16")
    result = memplan.estimate(config.model, inputs=config.inputs, device="cuda", gpu="H100-80GB", **config.settings)
    measured = _measured("gpt2-bf16")
    reserved = measured["measured_reserved_bytes"]
    assert abs(result.reserved_peak_bytes - reserved) <= 0.01 * reserved
    # max_memory_allocated counts the blocks the allocator hands out (a cached block up to 1 MiB
    # larger than the request, unsplit, counts whole): the simulator's count is within 0.1% of the
    # H100's (-0.04%), where the live tensors' bytes are 0.15% under it.
    allocated = measured["measured_peak_bytes"]
    assert abs(result.allocated_peak_bytes - allocated) <= 0.001 * allocated
    assert result.peak_bytes < allocated
