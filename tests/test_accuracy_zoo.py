"""Predicted peak vs a real CPU run of the canonical loop, for every model of the zoo.

Target (issue 2): |predicted - measured| <= 0.5% of measured, with --device cpu.
"""

import pytest

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.models.source import resolve_model
from tests.readme_zoo import readme_release_is_installed, readme_zoo_rows
from tests.zoo import TINY_HF_CONFIGS, ZOO_CASES

TOLERANCE = 0.005


CASES = [
    pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=case.known_miss)) if case.known_miss else case
    for case in ZOO_CASES
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in ZOO_CASES])
def test_predicted_peak_matches_real_cpu_run(case, tiny_model_dirs):
    model = tiny_model_dirs[case.model] if case.model in TINY_HF_CONFIGS else case.model
    spec = resolve_model(model, inputs=case.inputs, loss=case.loss)
    settings = spec.settings_for(case.settings)
    simulation = simulate(trace_step(spec, settings))
    measured = measure_cpu(spec, settings)
    error = (simulation.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    assert abs(error) <= TOLERANCE, (
        f"{case.id}: predicted {simulation.peak_bytes:,} B, measured {measured.peak_bytes:,} B ({error:+.3%})"
    )
    assert simulation.unsupported_ops == ()
    if readme_release_is_installed():  # the README's accuracy table shows this prediction, byte for byte
        shown = readme_zoo_rows()[case.id]
        assert shown == simulation.peak_bytes, (
            f"{case.id}: README {shown:,} B, memplan {simulation.peak_bytes:,} B; "
            "regenerate: python benchmarks/zoo_accuracy.py"
        )
