"""Every preset's architecture traces on the cuda target: each precision, three GPU generations,
with and without checkpointing (issue: grouped-query presets crashed on their defaults).

The models are the presets' own configs shrunk to a few dozen units wide, keeping what decides
the kernels: the ratio of query to key/value heads, the head count, the task head. The suite runs
each (architecture, precision) once; `benchmarks/cuda_matrix.py` runs the full product.
"""

from __future__ import annotations

import json

import pytest
import torch

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.presets import all_presets
from memplan.models.source import resolve_model
from memplan.settings import PRECISIONS, TrainingSettings
from tests.zoo import tiny_preset_config

GPUS = ("H100-80GB", "A100-80GB", "T4")


def _rope_kind(scaling) -> str | None:
    """Rotary scaling that runs code of its own in the forward (longrope, the dynamic kinds); the
    others (llama3, linear, yarn) only change the frequencies' values."""
    kind = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else None
    return kind if kind is not None and (kind == "longrope" or "dynamic" in kind) else None


def _kernel_key(preset) -> str:
    """What decides the kernels a preset's step runs: its architecture and task, the query to
    key/value head grouping, an explicit head size, rotary scaling that runs code of its own, sliding
    windows and logit soft-capping. Presets alike in all of these (Qwen2.5 sizes with the same
    grouping, Llama 3 and 3.1) are one case; sizes, epsilons and frequency values pick no kernels."""
    tiny = tiny_preset_config(preset)
    scaling = tiny.get("rope_scaling")
    return json.dumps(
        {
            "model_type": preset.model_type,
            "task": preset.task,
            "heads": [tiny.get(key) for key in ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")],
            "head_dim": "head_dim" in tiny,
            "rope": _rope_kind(scaling),
            "window": tiny.get("sliding_window") is not None,
            "softcap": tiny.get("attn_logit_softcapping") is not None,
        },
        sort_keys=True,
    )


# One preset per kernel key (gpt2 and gpt2-large alike).
ARCHITECTURES = sorted(
    {_kernel_key(preset): name for name, preset in all_presets().items() if not name.startswith("tiny-")}.values()
)
# Every (architecture, precision) once; the GPU rotates and checkpointing alternates, so each
# architecture meets every GPU and both checkpoint settings.
CASES = [
    (preset, precision, GPUS[(i + j) % len(GPUS)], "all" if (i + j) % 2 else "none")
    for i, preset in enumerate(ARCHITECTURES)
    for j, precision in enumerate(PRECISIONS)
]


@pytest.fixture(scope="module")
def tiny_presets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-presets")
    paths = {}
    for name in ARCHITECTURES:
        (folder / name).mkdir()
        # One block: what decides the kernels is in every block, and the suite stays short.
        (folder / name / "config.json").write_text(json.dumps(tiny_preset_config(all_presets()[name], layers=1)))
        paths[name] = str(folder / name)
    return paths


@pytest.mark.parametrize(("preset", "precision", "gpu", "checkpoint"), CASES)
def test_every_preset_architecture_traces_on_the_cuda_target(tiny_presets, preset, precision, gpu, checkpoint):
    spec = resolve_model(tiny_presets[preset], task=all_presets()[preset].task)
    task = all_presets()[preset].task
    shape = {"image_size": 32} if task == "image-classification" else {"seq_len": 32}
    settings = spec.settings_for(
        TrainingSettings(batch_size=2, precision=precision, gpu=gpu, checkpoint=checkpoint, **shape)
    )
    simulation = simulate(trace_step(spec, settings))
    assert simulation.unsupported_ops == ()
    assert simulation.reserved_peak_bytes >= simulation.peak_bytes > 0


def test_the_shrunk_presets_keep_their_grouped_query_ratio():
    for name in ARCHITECTURES:
        config, tiny = all_presets()[name].config, tiny_preset_config(all_presets()[name])
        if "num_key_value_heads" in config:
            grouped = config["num_key_value_heads"] < config["num_attention_heads"]
            assert (tiny["num_key_value_heads"] < tiny["num_attention_heads"]) == grouped, name


def test_grouped_query_attention_runs_only_flash_or_math():
    # Memory-efficient attention rejects unequal head counts (torch 2.11-2.14), so fp32 GQA, or
    # GQA with a mask, must reach the math backend with enable_gqa, never efficient with short k/v.
    from memplan.estimator.cuda.kernels import select_sdpa_backend

    q = torch.empty(2, 8, 128, 64, dtype=torch.float32)
    k = v = torch.empty(2, 2, 128, 64, dtype=torch.float32)
    assert select_sdpa_backend(q, k, v, None, True, True) == "math"
    q16, k16 = q.to(torch.bfloat16), k.to(torch.bfloat16)
    assert select_sdpa_backend(q16, k16, k16, None, True, True) == "flash"
    mask = torch.empty(2, 1, 128, 128, dtype=torch.bfloat16)
    assert select_sdpa_backend(q16, k16, k16, mask, False, True) == "math"
    assert select_sdpa_backend(q16.half(), k16.half(), k16.half(), None, True, True, (7, 5)) == "math"
