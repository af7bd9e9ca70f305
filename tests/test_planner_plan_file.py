"""A plan's settings against the step it is used for (memplan.planner.plan_file.check_settings)."""

import json
import re

import pytest

from memplan.checkpoint_layout import CheckpointLayout
from memplan.errors import PlanFileError
from memplan.planner.plan_file import Plan, check_settings, check_source
from memplan.settings import TrainingSettings


def _plan_document(**fields: object) -> dict:
    """A plan file's JSON document, as `memplan plan --output` writes one, with `fields` replaced."""
    from memplan.planner.plan_file import PLAN_FORMAT, PLAN_VERSION

    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "model": "gpt2",
        "fingerprint": "abc",
        "settings": {},
        "layout": {"segments": [["h.0"]], "policies": ["full"]},
        "budget_bytes": 2**30,
        "fits": True,
        "predicted_peak_bytes": 2**29,
        "recompute_flops": 0,
    } | fields


def _plan(settings: TrainingSettings) -> Plan:
    layout = CheckpointLayout(segments=(("transformer.h.0",),))
    return Plan("gpt2", "fingerprint", settings.to_dict(), layout, 2**30, True, 2**29, 0)


def test_no_gpu_is_the_default_card_on_the_cuda_target():
    check_settings(_plan(TrainingSettings(batch_size=4)), TrainingSettings(batch_size=4, gpu="H100-80GB"))
    check_settings(_plan(TrainingSettings(batch_size=4, gpu="H100-80GB")), TrainingSettings(batch_size=4))
    with pytest.raises(PlanFileError, match="gpu 'H100-80GB' in the plan, 'A100-40GB' here"):
        check_settings(_plan(TrainingSettings(batch_size=4)), TrainingSettings(batch_size=4, gpu="A100-40GB"))


def test_on_another_device_the_card_is_not_named_as_a_difference():
    with pytest.raises(PlanFileError) as refused:
        check_settings(_plan(TrainingSettings(batch_size=4, device="cpu")), TrainingSettings(batch_size=4))
    assert "(device 'cpu' in the plan, 'cuda' here)" in str(refused.value)


def test_a_wrapped_model_is_told_to_apply_the_plan_to_the_model_inside():
    import torch
    from torch import nn

    from memplan.errors import UsageError
    from memplan.models.fingerprint import model_fingerprint
    from memplan.planner.plan_file import apply_plan

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    layout = CheckpointLayout(segments=(("0",),))
    plan = Plan("mlp", model_fingerprint(model), TrainingSettings().to_dict(), layout, 2**30, True, 2**29, 0)
    for wrapped, inside in ((nn.DataParallel(model), "model.module"), (torch.compile(model), "model._orig_mod")):
        with pytest.raises(
            UsageError, match=re.escape(f"apply the plan to the model inside (`apply_plan({inside}, ...)`)")
        ):
            apply_plan(wrapped, plan)
    with pytest.raises(PlanFileError, match="fingerprint"):  # a wrapper around another model: the fingerprint says so
        apply_plan(nn.DataParallel(nn.Linear(4, 4)), plan)
    assert apply_plan(model, plan) == ["0"]
    unfitting = Plan("mlp", model_fingerprint(model), TrainingSettings().to_dict(), layout, 2**20, False, 2**21, 0)
    with pytest.warns(UserWarning, match=r"does not fit its budget \(2.00 MiB predicted, budget 1.00 MiB\)"):
        apply_plan(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), unfitting)


def test_a_plan_for_another_model_says_so_where_its_modules_are_missing(tmp_path):
    import memplan

    document = _plan_document(
        model="elsewhere",
        fingerprint="0123456789abcdef",
        settings=TrainingSettings(batch_size=2, device="cpu").to_dict(),
        layout={"segments": [["blocks.7"]], "policies": ["full"]},
    )
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    message = "the plan was made for another model (fingerprint 0123456789abcdef): the checkpoint layout names module"
    with pytest.raises(PlanFileError, match=re.escape(message)):
        memplan.estimate(
            "tests.test_checkpointing:sequential_stack",
            inputs="tests.test_checkpointing:rows",
            batch_size=2,
            device="cpu",
            checkpoint=str(path),
        )


def test_bytes_held_outside_the_allocator_do_not_change_the_plan():
    for outside in ({"cuda_context": 600 * 2**20}, {"nccl_memory": 2**30, "parallel": "ddp", "world_size": 2}):
        planned = TrainingSettings(**{key: outside[key] for key in ("parallel", "world_size") if key in outside})
        check_settings(_plan(planned), TrainingSettings(**outside))


def test_a_setting_that_changes_the_trace_refuses_the_plan():
    with pytest.raises(PlanFileError, match="precision 'fp32' in the plan, 'amp-bf16' here"):
        check_settings(_plan(TrainingSettings()), TrainingSettings(precision="amp-bf16"))


def test_a_plan_traced_with_other_inputs_is_refused_and_one_from_before_they_were_kept_is_not(tmp_path):
    """The fingerprint sees the parameters only: the same model fed a wider batch (or another loss) is another
    step, whose planned peak the plan does not predict."""
    import json

    import memplan
    from memplan.planner.plan_file import load_plan, write_plan

    model = "tests.zoo_models:linear_stack"
    common = {"loss": "tests.zoo_models:mean_square_loss", "device": "cpu", "batch_size": 4}
    made = memplan.plan(model, budget="1GiB", inputs="tests.zoo_models:features_inputs", **common)
    path = tmp_path / "plan.json"
    write_plan(made, path)
    document = json.loads(path.read_text())
    assert document["source"] == {
        "inputs": "tests.zoo_models:features_inputs",
        "loss": "tests.zoo_models:mean_square_loss",
        "task": None,
    }
    same = memplan.estimate(model, checkpoint=str(path), inputs="tests.zoo_models:features_inputs", **common)
    assert same.peak_bytes == made.predicted_peak_bytes
    with pytest.raises(
        PlanFileError, match="inputs tests.zoo_models:features_inputs in the plan, tests.zoo_models:flat"
    ):
        memplan.estimate(model, checkpoint=str(path), inputs="tests.zoo_models:flat_inputs", **common)
    with pytest.raises(PlanFileError, match="--loss tests.zoo_models:mean_square_loss in the plan, [(]none[)] here"):
        check_source(load_plan(path), {"inputs": "tests.zoo_models:features_inputs", "loss": None, "task": None})
    del document["source"]  # as plan files were written before 2026-11-29
    path.write_text(json.dumps(document))
    assert load_plan(path).source is None
    flat = memplan.estimate(model, checkpoint=str(path), inputs="tests.zoo_models:flat_inputs", **common)
    assert flat.peak_bytes < same.peak_bytes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layout": None}, "'layout' is None, not an object of segments and policies"),
        ({"layout": {"segments": [[0]]}}, "segments are lists of module names"),
        ({"layout": {"segments": [["h.0"]], "policies": "full"}}, "policies are a list"),
        ({"budget_bytes": "lots"}, "'budget_bytes' is 'lots', not a whole number of bytes"),
        ({"budget_bytes": True}, "'budget_bytes' is True, not a whole number of bytes"),
        ({"fits": "yes"}, "'fits' is 'yes', not true or false"),
        ({"model": None}, "has no 'model' field"),
        ({"source": [1]}, "'source' is not the model's inputs, loss and task"),
        ({"budget_bytes": -5}, "'budget_bytes' is -5, not a size"),
        ({"budget_bytes": 10**400}, "'budget_bytes' is 1000"),
        ({"version": "2"}, "is plan format version '2'; this memplan reads version 2"),
        ({"version": True}, "is plan format version True"),
    ],
)
def test_a_mangled_plan_file_is_refused_in_one_line_naming_what_is_wrong(tmp_path, change, message):
    import json

    from memplan.planner.plan_file import load_plan

    document = _plan_document(source={"inputs": None, "loss": None, "task": None})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    assert load_plan(path).layout.modules == ("h.0",)
    document.update(change)
    if change.get("model", "") is None:
        del document["model"]
    path.write_text(json.dumps(document))
    with pytest.raises(PlanFileError, match=re.escape(message)):
        load_plan(path)


def test_a_plan_file_that_is_not_utf8_text_is_refused_in_one_line(tmp_path):
    from memplan.planner.plan_file import load_plan

    path = tmp_path / "plan.json"
    path.write_bytes(b'{"format": "memplan-plan", "model": "caf\xe9"}')  # saved as latin-1
    with pytest.raises(PlanFileError, match=re.escape("is not a UTF-8 text file (byte 40: invalid continuation byte)")):
        load_plan(path)


def test_what_memplan_plan_returns_is_a_plan_as_its_file_is(tmp_path):
    """apply_plan refused the PlanResult memplan.plan returns ("got a PlanResult"); it and an estimate's checkpoint=
    take it as the file written from it."""
    import memplan
    from memplan.planner.plan_file import write_plan
    from tests.zoo_models import features_inputs, linear_stack, mean_square_loss

    source = {"inputs": features_inputs, "loss": mean_square_loss, "batch_size": 64, "device": "cpu"}
    unplanned = memplan.estimate(linear_stack(), **source)
    result = memplan.plan(linear_stack(), **source, budget=int(unplanned.peak_bytes * 0.9))
    assert result.fits and result.layout.segments  # it checkpoints something
    path = tmp_path / "plan.json"
    write_plan(result, path)
    by_file, by_result = linear_stack(), linear_stack()
    assert memplan.apply_plan(by_result, result) == memplan.apply_plan(by_file, path)
    estimates = [memplan.estimate(linear_stack(), **source, checkpoint=plan) for plan in (path, result)]
    assert estimates[0].peak_bytes == estimates[1].peak_bytes == result.predicted_peak_bytes
