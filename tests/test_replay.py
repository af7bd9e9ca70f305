"""The optimizer step replayed from an earlier trace gives the very trace that tracing it again gives."""

import pytest
import torch

from memplan.checkpoint_layout import CheckpointLayout
from memplan.estimator.checkpointing import all_blocks_layout, layout_applied
from memplan.estimator.replay import OptimizerRecording, RecordedOp
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import build_fake_setup, trace_step
from memplan.models.source import resolve_model
from tests.zoo import TINY_HF_CONFIGS, ZOO_CASES

# Every optimizer and precision memplan traces, gradient accumulation, tied and frozen weights.
REPLAYED = [
    "gpt2-adamw",
    "llama-checkpoint-segment-amp",
    "bert-sgd-momentum-accum",
    "distilbert-adam-checkpoint",
    "t5-adafactor",
    "llama-bf16-sgd",
    "tied-weights",
    "reused-module-adam8bit",
    "frozen-submodule",
    "lstm-accum",
]
CASES = {case.id: case for case in ZOO_CASES}
# On a cuda target: foreach AdamW, and amp-fp16's GradScaler unscaling the gradients in place.
CUDA_SETTINGS = {"device": "cuda", "gpu": "A100-80GB", "precision": "amp-fp16"}


def _spec_and_settings(case_id, tiny_model_dirs, **changes):
    case = CASES[case_id]
    model = tiny_model_dirs[case.model] if case.model in TINY_HF_CONFIGS else case.model
    spec = resolve_model(model, inputs=case.inputs, loss=case.loss)
    return spec, spec.settings_for(case.settings.replace(**changes))


def _fingerprint(traced):
    simulation = simulate(traced)
    return {
        "ops": [str(node.target) for node in traced.graph.nodes],
        "peak": simulation.peak_bytes,
        "phases": simulation.phase_peak_bytes,
        "breakdown": simulation.breakdown,
        "timeline": simulation.timeline_bytes,
        "reserved": simulation.reserved_peak_bytes,
    }


def _layout(checkpoint, model):
    if isinstance(checkpoint, CheckpointLayout):
        return checkpoint
    if checkpoint == "none":
        return CheckpointLayout()
    return all_blocks_layout(model, "full" if checkpoint == "all" else checkpoint)


@pytest.mark.parametrize(
    ("case_id", "changes"),
    [(case_id, {}) for case_id in REPLAYED] + [("gpt2-checkpoint-all", CUDA_SETTINGS)],
    ids=[*REPLAYED, "gpt2-checkpoint-all-cuda-amp-fp16"],
)
def test_replayed_step_equals_traced_step(case_id, changes, tiny_model_dirs):
    """As the planner does: trace without checkpointing, then the case's layout at another batch size."""
    spec, settings = _spec_and_settings(case_id, tiny_model_dirs, **changes)
    plain = settings.replace(checkpoint="none")
    setup = build_fake_setup(spec, plain)
    first = trace_step(spec, plain, setup)
    assert first.optimizer_recording is not None and first.optimizer_recording.ops
    layout = _layout(settings.checkpoint, setup.state.model)
    later = settings.replace(batch_size=settings.batch_size + 1, checkpoint=layout)
    with layout_applied(setup.state.model, layout):
        # Twice: the first run of an op at new shapes misses FakeTensorMode's dispatch cache, and
        # on a miss mkldnn_rnn_layer_backward's meta kernel returns outputs sharing one storage
        # (lstm-accum: 1,536 B less than with the cache's separate outputs, and than measured).
        trace_step(spec, later, setup)
        traced = trace_step(spec, later, setup)
        replayed = trace_step(spec, later, setup, first.optimizer_recording)
    assert replayed.optimizer_recording is first.optimizer_recording  # the replay was used
    assert traced.optimizer_recording is not first.optimizer_recording
    assert _fingerprint(replayed) == _fingerprint(traced)


def _same_layout(a, b):
    return (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def test_replay_refused_when_gradients_differ(tiny_model_dirs):
    spec, settings = _spec_and_settings("gpt2-adamw", tiny_model_dirs)
    setup = build_fake_setup(spec, settings)
    first = trace_step(spec, settings, setup)
    recording = first.optimizer_recording
    grads = [torch.empty_like(grad) for grad in recording.grads]
    assert recording.matches(grads)
    assert not recording.matches(grads[:-1])
    assert not recording.matches([grads[0].reshape(-1), *grads[1:]])  # another shape
    assert not recording.matches([grads[0].t(), *grads[1:]])  # other strides
    # Two gradients of the same layout (GPT-2's ln_1 and ln_2 weights, say) sharing one storage.
    first_index, second_index = next(
        (i, j) for i in range(len(grads)) for j in range(i + 1, len(grads)) if _same_layout(grads[i], grads[j])
    )
    shared = list(grads)
    shared[second_index] = shared[first_index]
    assert not recording.matches(shared)
    # A recording that read a tensor which does not outlive its trace cannot be replayed.
    with setup.fake_mode:
        temporary = torch.empty(3)
        out = temporary + 1
    stray = OptimizerRecording(grads=[], ops=[RecordedOp(torch.ops.aten.add.Tensor, (temporary, 1), {}, out, out)])
    assert not stray.is_replayable(persistent=[])
    assert stray.is_replayable(persistent=[temporary])
