import gc
import os

import pytest

# Every command in the tests traces: memplan's answer cache (memplan.cli.cache) would answer a
# command that a test runs again after changing what it depends on through a patch. The cache's
# own tests turn it on for themselves.
os.environ["MEMPLAN_NO_CACHE"] = "1"
# Where stderr is no terminal, a command prints plain progress lines once it has run 3 s
# (memplan.cli.running): a test that reads a command's whole output as one line would then depend on
# how busy the machine is (pytest -n shares the cores). The progress tests set their own threshold.
os.environ["MEMPLAN_PROGRESS_AFTER_SECONDS"] = "600"
# Under pytest -n each worker already has a core: a second trace forked beside each estimate's first
# (memplan.forked) only oversubscribes them (the suite took 4 min 38 s with it, 3 min 56 s without, on the
# 2-core CI machine). tests/test_forked.py gives memplan its cores back where it checks the forked paths.
# For the same reason each worker runs torch's CPU kernels on one thread (and so do the processes it starts: the
# validator's workers, `python -m memplan`): with two workers on two cores, each worker's second OpenMP thread
# spin-waits on a core the other worker needs. Measured on this 2-core machine, tests/test_distributed_ddp.py and
# tests/test_accuracy_zoo.py under `pytest -n 2`: 149 and 172 s of wall time with torch's default two threads per
# worker, 88 and 108 s with one (2026-12-06, with other jobs beside them). The paths CPU kernels take on several
# threads (reductions' per-thread partials) still run where the tests run in one process: `pytest` alone, and CI's
# torch 2.11 leg.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["MEMPLAN_JOBS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

# Collecting imports torch, transformers, DeepSpeed and the tests' modules: about a million objects and
# hardly any garbage, which each full collection would walk again (memplan.cli.collector says the same of
# the command line). The collector is off until collection ends: 7.2 s -> 5.0 s per pytest-xdist worker.
gc.disable()


def pytest_collection_finish(session):
    gc.enable()


from tests.zoo import TINY_HF_CONFIGS, write_tiny_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Tiny transformers configs written as model directories (the config.json model source)."""
    folder = tmp_path_factory.mktemp("tiny-models")
    return {name: write_tiny_config(name, folder) for name in TINY_HF_CONFIGS}


@pytest.fixture
def no_fallback_kernel(monkeypatch):
    """A trace in which FakeTensorMode runs no op's real kernel over zero-filled tensors (`run_fallback_kernel`, for
    an op with no fake kernel): the fallback's output is right, but it costs the real op's time at the traced sizes
    (the CTC backward: 22 s at the batches a largest-batch search tries)."""
    from torch._subclasses import fake_tensor

    def refused(fake_mode, func, *args, **kwargs):
        raise AssertionError(f"{func} ran its real kernel under the fake mode (no fake kernel, no memplan rule)")

    monkeypatch.setattr(fake_tensor, "run_fallback_kernel", refused)


@pytest.fixture
def measure_in_this_process(monkeypatch):
    """validate's real measurement (memplan.validate.measure, what its worker process runs) made in the
    test's own process: the worker's start-up (torch, torch._dynamo for the optimizer, transformers:
    about 4 s each) is what such a test would otherwise spend its time on. The worker process itself is
    tested where it is the point (tests/test_validate.py)."""
    import dataclasses

    from memplan.models.source import resolve_model
    from memplan.validate import runner
    from memplan.validate.measure import measure

    def measure_here(model, settings, *, warmup, snapshot=None, timeout_s=None):
        spec = resolve_model(**model.to_dict())
        return dataclasses.asdict(measure(spec, settings, warmup=warmup, snapshot=snapshot))

    monkeypatch.setattr(runner, "measure_in_subprocess", measure_here)


@pytest.fixture(autouse=True)
def _no_fake_group_outlives_its_test():
    """A rank traced by calling trace_step directly (not through the API, whose entry points release it) leaves
    its fake default group in place for as long as the rank lives (memplan.distributed.fake_group): a later test
    that makes a group of its own found one already ("trying to initialize the default process group twice")."""
    yield
    from memplan.distributed.fake_group import release_lingering_group

    release_lingering_group()


@pytest.fixture(autouse=True)
def _collector_spares_earlier_tests():
    """What the worker holds from earlier tests (and the imports) is frozen for the test's length, as the
    command line freezes what its imports made (memplan.cli.collector, collect_less): a test's collections,
    and the measurements' own (tests.hand_measure, memplan.measure.collector), walk what the test makes,
    not a whole worker's objects. Given back after, so that nothing stays frozen past its test. Through memplan's
    own pair, so that a library call in the test knows without counting them (memplan.estimator.collector)."""
    from memplan.estimator.collector import freeze_existing_objects, unfreeze_objects

    freeze_existing_objects()
    yield
    unfreeze_objects()


@pytest.fixture
def recordings(monkeypatch):
    """Weak references to every trace's recorder made while the test runs: a recording some cycle keeps alive
    after the trace outlives gc.collect() (tests/test_custom_step.py, tests/test_trace_lifetimes.py)."""
    import weakref

    from memplan.estimator.recorder import GraphRecorder

    made: list[weakref.ref] = []
    original_init = GraphRecorder.__init__

    def remembered(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(GraphRecorder, "__init__", remembered)
    return made
