"""A plan's settings against the step it is used for (memplan.planner.plan_file.check_settings)."""

import pytest

from memplan.checkpoint_layout import CheckpointLayout
from memplan.errors import PlanFileError
from memplan.planner.plan_file import Plan, check_settings
from memplan.settings import TrainingSettings


def _plan(settings: TrainingSettings) -> Plan:
    layout = CheckpointLayout(segments=(("transformer.h.0",),))
    return Plan("gpt2", "fingerprint", settings.to_dict(), layout, 2**30, True, 2**29, 0)


def test_no_gpu_is_the_default_card_on_the_cuda_target():
    check_settings(_plan(TrainingSettings(batch_size=4)), TrainingSettings(batch_size=4, gpu="H100-80GB"))
    check_settings(_plan(TrainingSettings(batch_size=4, gpu="H100-80GB")), TrainingSettings(batch_size=4))
    with pytest.raises(PlanFileError, match="gpu 'H100-80GB' in the plan, 'A100-40GB' here"):
        check_settings(_plan(TrainingSettings(batch_size=4)), TrainingSettings(batch_size=4, gpu="A100-40GB"))


def test_bytes_held_outside_the_allocator_do_not_change_the_plan():
    for outside in ({"cuda_context": 600 * 2**20}, {"nccl_memory": 2**30, "parallel": "ddp", "world_size": 2}):
        planned = TrainingSettings(**{key: outside[key] for key in ("parallel", "world_size") if key in outside})
        check_settings(_plan(planned), TrainingSettings(**outside))


def test_a_setting_that_changes_the_trace_refuses_the_plan():
    with pytest.raises(PlanFileError, match="precision 'fp32' in the plan, 'amp-bf16' here"):
        check_settings(_plan(TrainingSettings()), TrainingSettings(precision="amp-bf16"))
