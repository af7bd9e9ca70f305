"""Where one `memplan estimate gpt2 -b 8 --seq-len 1024` (cuda target) spends its time, phase by phase, in one process.

Usage: python benchmarks/estimate_phases.py [--collect-less] [--no-collector]
The phases in order: importing torch; transformers and memplan; the first FakeTensorMode() (which
imports torch._dynamo); resolving the model; building it and the optimizer's state under fake
tensors; each of the estimate's two traces and its simulation; then, apart, one more device fit of
the first trace's timeline (the allocator replays a budget search repeats).
`--collect-less` applies what the CLI does after its imports (memplan.cli.collector.collect_less:
gc.freeze and higher thresholds); `--no-collector` turns Python's cyclic collector off altogether.
"""

from __future__ import annotations

import sys
import time

started = time.perf_counter()
marks: list[tuple[str, float]] = []


def mark(name: str) -> None:
    marks.append((name, time.perf_counter()))


import torch  # noqa: E402

mark("import torch")
import transformers  # noqa: E402, F401

from memplan.estimator.estimate import second_batch_size  # noqa: E402
from memplan.estimator.simulate import simulate  # noqa: E402
from memplan.estimator.timeline import device_fit_bytes  # noqa: E402
from memplan.estimator.trace import build_fake_setup, trace_step  # noqa: E402
from memplan.models.source import resolve_model  # noqa: E402
from memplan.settings import TrainingSettings  # noqa: E402

mark("import transformers and memplan")
if "--collect-less" in sys.argv:
    from memplan.cli.collector import collect_less

    collect_less()
if "--no-collector" in sys.argv:
    import gc

    gc.disable()
torch._subclasses.fake_tensor.FakeTensorMode()
mark("first FakeTensorMode()")
spec = resolve_model("gpt2")
settings = spec.settings_for(TrainingSettings(batch_size=8, seq_len=1024))
mark("resolve the model")
setup = build_fake_setup(spec, settings)
mark("build the model and the optimizer state")
first = trace_step(spec, settings, setup, None)
mark("first trace")
timeline = simulate(first).timeline
mark("its simulation")
second = trace_step(spec, settings.replace(batch_size=second_batch_size(8)), setup, first.optimizer_recording)
mark("second trace")
simulate(second)
mark("its simulation")
previous = started
for name, at in marks:
    print(f"{name:42s} {at - previous:5.2f} s")
    previous = at
print(f"{'total':42s} {previous - started:5.2f} s")
fit_started = time.perf_counter()
device_fit_bytes(timeline, settings.allocator_config)
print(f"{'one device fit of the first timeline':42s} {time.perf_counter() - fit_started:5.3f} s")
