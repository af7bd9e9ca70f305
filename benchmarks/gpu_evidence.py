"""Measure validation suites on a GPU cheaply, predict them elsewhere, and merge the two.

GPU time is short, so the three halves of `memplan validate --suite` run apart:

    # on the GPU machine, from the source tree (no prediction there: measuring only)
    PYTHONPATH=. python3 benchmarks/gpu_evidence.py environment --out $OUT/environment.json
    PYTHONPATH=. python3 benchmarks/gpu_evidence.py measure main --out $OUT
    PYTHONPATH=. python3 benchmarks/gpu_evidence.py measure extended --out $OUT --only id,id
    PYTHONPATH=. python3 benchmarks/gpu_evidence.py capped --out $OUT       # the fit promises
    python benchmarks/gpu_evidence.py predict-capped     # (here, beforehand) the promises they test
    # anywhere with the same torch (predictions do not need the GPU)
    python benchmarks/gpu_evidence.py predict main --gpu H100-80GB --out docs/validation/predicted-main.json
    python benchmarks/gpu_evidence.py merge main --gpu H100-80GB ...

`measure` imports torch, transformers and memplan once and forks a fresh child per configuration
before CUDA starts (the parent never touches CUDA), so each configuration gets a new CUDA context
and caching allocator, as `validate`'s worker subprocess gives it, without paying the imports
each time. Results are rewritten after every configuration, so a run stopped at its time limit
keeps what it measured. Each measured iteration's allocator events (no stacks) go into one
tar.gz beside the results, for studying misses against memplan's own timeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memplan.outputs import write_atomically  # noqa: E402
from memplan.validate.result import relative_error  # noqa: E402
from memplan.validate.suite import SuiteConfig, suite_named  # noqa: E402

WARMUP = 2
TIMEOUT_SECONDS = 240


def _settings_for(config: SuiteConfig, device: str) -> tuple[Any, Any]:
    from memplan.api_arguments import settings_from
    from memplan.models.source import resolve_model

    settings, _ = settings_from(None, {**config.settings, "device": device}, config.inputs)
    spec = resolve_model(config.model, inputs=config.inputs)
    return spec, spec.settings_for(settings)


def _child(config: SuiteConfig, trace_path: str | None, capacity_bytes: int | None, connection: Any) -> None:
    try:
        from memplan.validate.measure import measure

        spec, settings = _settings_for(config, "cuda")
        result = measure(spec, settings, warmup=WARMUP, capacity_bytes=capacity_bytes, allocator_trace=trace_path)
        connection.send({"measurement": dataclasses.asdict(result), "settings": settings.to_dict()})
    except BaseException as error:  # noqa: BLE001 - the parent records any failure as this config's result
        connection.send({"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]})


def _run_forked(config: SuiteConfig, trace_path: str | None, capacity_bytes: int | None, timeout: float) -> dict:
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(config, trace_path, capacity_bytes, sender))
    started = time.perf_counter()
    process.start()
    sender.close()
    if receiver.poll(timeout):
        try:
            answer = receiver.recv()
        except EOFError:
            answer = {"error": "the measuring process died without an answer"}
    else:
        answer = {"error": f"ran past {timeout:.0f} s and was stopped"}
        process.kill()
    process.join(30)
    if process.exitcode not in (0, None) and "error" not in answer and "measurement" not in answer:
        answer = {"error": f"the measuring process exited with {process.exitcode}"}
    answer["wall_seconds"] = round(time.perf_counter() - started, 2)
    return answer


def _write(path: Path, document: dict) -> None:
    text = (json.dumps(document, indent=1) + "\n").encode()
    write_atomically(path, lambda file: file.write(text), "results")


def _pack(trace_dir: Path, archive: Path) -> None:
    with tarfile.open(archive, "w:gz") as tar:
        for file in sorted(trace_dir.glob("*.json")):
            tar.add(file, arcname=file.name)


def measure_suite(name: str, out: Path, only: set[str] | None, timeout: float) -> None:
    import torch  # noqa: F401 - imported once, before the fork, never initialising CUDA here
    import transformers  # noqa: F401

    import memplan.validate.measure  # noqa: F401

    results = out / f"measured-{name}.json"
    document = json.loads(results.read_text()) if results.exists() else {"suite": name, "configs": []}
    done = {entry["id"] for entry in document["configs"]}
    trace_dir = Path(f"/tmp/memplan-traces-{name}")
    trace_dir.mkdir(parents=True, exist_ok=True)
    for config in suite_named(name):
        if (only and config.id not in only) or config.id in done:
            continue
        answer = _run_forked(config, str(trace_dir / f"{config.id}.json"), None, timeout)
        document["configs"].append({"id": config.id, "model": config.model, **answer})
        _write(results, document)
        _pack(trace_dir, out / f"traces-{name}.tar.gz")
        measured = answer.get("measurement") or {}
        print(
            f"{config.id}: allocated {measured.get('peak_bytes')} reserved {measured.get('reserved_bytes')} "
            f"device {measured.get('device_used_bytes')} step {measured.get('step_seconds')} "
            f"{answer.get('error', '')} ({answer['wall_seconds']} s)",
            flush=True,
        )


def _environment_child(connection: Any) -> None:
    import subprocess

    import torch

    facts: dict[str, Any] = {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
    }
    try:
        facts["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        facts["nvidia_smi"] = f"unavailable: {error}"
    facts["cuda_module_loading"] = os.environ.get("CUDA_MODULE_LOADING", "(unset: torch sets LAZY)")

    def used() -> dict[str, int]:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {
            "device_used_bytes": total - free,
            "total_bytes": total,
            "reserved_bytes": torch.cuda.memory_reserved(),
        }

    torch.cuda.init()
    facts["device_name"] = torch.cuda.get_device_name()
    facts["compute_capability"] = list(torch.cuda.get_device_capability())
    # The context on its own: a one-element tensor makes CUDA create its primary context.
    torch.empty(1, device="cuda")
    facts["after_first_tensor"] = used()
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()
    facts["after_fp32_matmul"] = used()
    b = a.bfloat16()
    (b @ b).float().sum().item()
    facts["after_bf16_matmul"] = used()
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
    conv(torch.randn(8, 64, 56, 56, device="cuda")).sum().backward()
    facts["after_cudnn_conv"] = used()
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    facts["after_sdpa"] = used()
    connection.send(facts)


def environment(out: Path) -> None:
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_environment_child, args=(sender,))
    process.start()
    sender.close()
    try:
        facts = receiver.recv() if receiver.poll(120) else {"error": "timed out"}
    except EOFError:  # the child failed before it sent anything (its traceback is on stderr)
        process.join(30)
        facts = {"error": f"the environment's process exited with {process.exitcode}"}
    process.join(30)
    import transformers

    facts["transformers_version"] = transformers.__version__
    facts["python"] = sys.version.split()[0]
    out.write_text(json.dumps(facts, indent=1) + "\n")
    print(json.dumps(facts, indent=1))


# The fit promises: (id, model, settings, cap for torch). Filled from `memplan estimate --budget`
# predictions made beforehand (docs/validation.md says which); the cap is the same budget.
CAPPED_FILE = Path(__file__).resolve().parent.parent / "docs" / "validation" / "capped-runs.json"


def capped(out: Path, timeout: float) -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import memplan.validate.measure  # noqa: F401

    runs = json.loads(CAPPED_FILE.read_text())["runs"]
    results = out / "measured-capped.json"
    document = {"runs": []}
    for run in runs:
        config = SuiteConfig(run["id"], run["model"], run["settings"], run.get("inputs"))
        answer = _run_forked(config, None, run["capacity_bytes"], timeout)
        document["runs"].append({**run, **answer})
        _write(results, document)
        measured = answer.get("measurement") or {}
        print(
            f"{run['id']}: oom {measured.get('out_of_memory')} allocated {measured.get('peak_bytes')} "
            f"reserved {measured.get('reserved_bytes')} {answer.get('error', '')} ({answer['wall_seconds']} s)",
            flush=True,
        )


def predict_capped(path: Path = CAPPED_FILE) -> None:
    """Make the fit promises' predictions anew with today's memplan (no GPU needed): for each search
    (a model, its settings and a cap), memplan's largest batch at the cap and the next one, each with
    its figures; the planned rows are kept as they are (their plan file is `memplan plan`'s)."""
    import torch

    import memplan

    document = json.loads(path.read_text())
    gpu = document["gpu"]
    searches: dict[str, dict] = {}
    kept = []
    for run in document["runs"]:
        if "predicted_max_batch_size" not in run:
            kept.append(run)
            continue
        settings = {key: value for key, value in run["settings"].items() if key != "batch_size"}
        key = json.dumps([run["model"], settings, run["capacity_bytes"], run.get("inputs")], sort_keys=True)
        searches.setdefault(key, {"run": run, "settings": settings, "first": run["settings"]["batch_size"]})
    runs = []
    for search in searches.values():
        run, settings, capacity = search["run"], search["settings"], search["run"]["capacity_bytes"]
        found = memplan.estimate(
            run["model"],
            inputs=run.get("inputs"),
            device="cuda",
            gpu=gpu,
            batch_size=search["first"],
            budget=capacity,
            **settings,
        ).max_batch_size
        prefix = run["id"].rsplit("-b", 1)[0]
        suffix = run["id"].rsplit("-cap", 1)[1]
        for batch in (found, found + 1):
            result = memplan.estimate(
                run["model"], inputs=run.get("inputs"), device="cuda", gpu=gpu, batch_size=batch, **settings
            )
            runs.append(
                {
                    "id": f"{prefix}-b{batch}-cap{suffix}",
                    "model": run["model"],
                    "settings": {**settings, "batch_size": batch},
                    "capacity_bytes": capacity,
                    "predicted_fits": batch == found,
                    "predicted_peak_bytes": result.allocated_peak_bytes,
                    "predicted_reserved_bytes": result.reserved_peak_bytes,
                    "predicted_smallest_device_bytes": result.smallest_device_bytes,
                    "predicted_max_batch_size": found,
                }
            )
            print(f"{runs[-1]['id']}: fits {runs[-1]['predicted_fits']}", flush=True)
    document["runs"] = runs + kept
    document["made_with"] = (
        f"python benchmarks/gpu_evidence.py predict-capped: memplan.estimate(model, device='cuda', gpu='{gpu}', "
        f"budget=capacity_bytes, ...) on torch {torch.__version__} (CPU), before the GPU runs; the plan with "
        "`memplan plan gpt2-medium -b 16 --seq-len 1024 --precision amp-bf16 --gpu H100-80GB --budget 20GiB`"
    )
    _write(path, document)


def predict(name: str, gpu: str, out: Path, only: set[str] | None) -> None:
    """memplan's predictions for a suite's configurations on `gpu` (no GPU needed), appended to `out`."""
    import torch

    import memplan
    from memplan.version import __version__

    document = json.loads(out.read_text()) if out.exists() else {"suite": name, "gpu": gpu, "configs": []}
    document["predicted_with"] = f"memplan {__version__}, torch {torch.__version__}, on a CPU (no GPU)"
    done = {entry["id"] for entry in document["configs"]}
    for config in suite_named(name):
        if (only and config.id not in only) or config.id in done:
            continue
        started = time.perf_counter()
        try:
            result = memplan.estimate(config.model, inputs=config.inputs, device="cuda", gpu=gpu, **config.settings)
            entry = {
                # what max_memory_allocated counts (the allocator's whole blocks), beside the live tensors
                "predicted_peak_bytes": result.allocated_peak_bytes,
                "predicted_live_tensor_peak_bytes": result.peak_bytes,
                "predicted_reserved_bytes": result.reserved_peak_bytes,
                # the measured rank runs on torch's fake process group: no NCCL communicator to count
                "predicted_device_bytes": result.device_bytes_without_nccl,
                "predicted_smallest_device_bytes": result.smallest_device_bytes,
                "predicted_conv_band_low_reserved_bytes": result.conv_workspace_free_reserved_peak_bytes,
                "predicted_paged_optimizer_bytes": result.paged_optimizer_bytes,
                "settings": result.settings.to_dict(),
                "notes": list(getattr(result, "notes", ()) or ()),
            }
        except Exception as error:  # noqa: BLE001 - recorded as this configuration's result
            entry = {"error": f"{type(error).__name__}: {error}"}
        entry["predict_seconds"] = round(time.perf_counter() - started, 2)
        document["configs"].append({"id": config.id, "model": config.model, **entry})
        _write(out, document)
        print(f"{config.id}: {entry.get('predicted_peak_bytes')} {entry.get('error', '')}", flush=True)


def merge(predicted_path: Path, measured_path: Path, environment_path: Path, out: Path) -> dict:
    """One results document per suite and GPU: the issue's fields, prediction beside measurement."""
    predictions = json.loads(predicted_path.read_text())
    measured = json.loads(measured_path.read_text())
    facts = json.loads(environment_path.read_text())
    by_id = {entry["id"]: entry for entry in predictions["configs"]}
    configs = []
    for entry in measured["configs"]:
        guess = by_id.get(entry["id"], {})
        real = entry.get("measurement") or {}
        row = {
            "id": entry["id"],
            "model": entry["model"],
            "settings": guess.get("settings") or entry.get("settings"),
            "predicted_peak_bytes": guess.get("predicted_peak_bytes"),
            "measured_peak_bytes": real.get("peak_bytes"),
            "predicted_reserved_bytes": guess.get("predicted_reserved_bytes"),
            "measured_reserved_bytes": real.get("reserved_bytes"),
            "predicted_device_bytes": guess.get("predicted_device_bytes"),
            "measured_device_bytes": real.get("device_used_bytes"),
            "step_seconds": real.get("step_seconds"),
            "attention_ops": real.get("attention_ops"),
            "out_of_memory": real.get("out_of_memory", False),
            "error": entry.get("error") or guess.get("error"),
        }
        row["relative_error"] = relative_error(row["predicted_peak_bytes"], row["measured_peak_bytes"])
        row["reserved_relative_error"] = relative_error(row["predicted_reserved_bytes"], row["measured_reserved_bytes"])
        row["device_relative_error"] = relative_error(row["predicted_device_bytes"], row["measured_device_bytes"])
        configs.append(row)
    driver = facts.get("nvidia_smi", "").split(", ")
    document = {
        "suite": measured["suite"],
        "device_name": facts.get("device_name"),
        "torch_version": facts.get("torch_version"),
        "cuda_version": facts.get("cuda_version"),
        "cudnn_version": facts.get("cudnn_version"),
        "driver_version": driver[1] if len(driver) > 1 else None,
        "transformers_version": facts.get("transformers_version"),
        "predicted_with": predictions.get("predicted_with"),
        "gpu_setting": predictions.get("gpu"),
        "configs": configs,
    }
    _write(out, document)
    return document


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:+.2f}%"


def _gib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**30:.3f}"


def table(results: Path) -> str:
    """The markdown table of one merged results document, and its summary line."""
    import statistics

    document = json.loads(results.read_text())
    lines = [
        "| configuration | allocated GiB | error | reserved GiB | error | device GiB | error | step ms | attention |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in document["configs"]:
        kernels = sorted(
            {name.split("_scaled_dot_product_")[-1].removesuffix("_backward") for name in row["attention_ops"] or ()}
        )
        lines.append(
            f"| {row['id']} | {_gib(row['measured_peak_bytes'])} | {_percent(row['relative_error'])} "
            f"| {_gib(row['measured_reserved_bytes'])} | {_percent(row['reserved_relative_error'])} "
            f"| {_gib(row['measured_device_bytes'])} | {_percent(row['device_relative_error'])} "
            f"| {row['step_seconds'] * 1000:.0f} | {', '.join(kernels) or 'none (math or eager)'} |"
        )
    summary = []
    for key, name in (
        ("relative_error", "allocated"),
        ("reserved_relative_error", "reserved"),
        ("device_relative_error", "device"),
    ):
        errors = [abs(row[key]) for row in document["configs"] if row[key] is not None]
        worst = max(document["configs"], key=lambda row: abs(row[key] or 0))
        summary.append(
            f"{name}: median |error| {statistics.median(errors) * 100:.2f}%, "
            f"worst {worst[key] * 100:+.2f}% ({worst['id']})"
        )
    lines.append("")
    lines.append(f"{len(document['configs'])} configurations; " + "; ".join(summary) + ".")
    beyond = [
        (row["measured_device_bytes"] - row["measured_reserved_bytes"]) / 2**20
        for row in document["configs"]
        if row["measured_device_bytes"] is not None and row["measured_reserved_bytes"] is not None
    ]
    if beyond:
        lines.append(
            f"Measured device − reserved (the CUDA context and the kernels loaded lazily): {min(beyond):.1f} to "
            f"{max(beyond):.1f} MiB, median {statistics.median(beyond):.1f} MiB."
        )
    return "\n".join(lines)


def write_table(results: Path, markdown: Path) -> None:
    """Replace the block between `<!-- NAME:begin -->` and `<!-- NAME:end -->` (NAME: the results
    file's stem) in `markdown` with the table."""
    begin, end = f"<!-- {results.stem}:begin -->", f"<!-- {results.stem}:end -->"
    text = markdown.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{markdown} has no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    markdown.write_text(f"{head}{begin}\n{table(results)}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("environment")
    env.add_argument("--out", type=Path, required=True)
    run = commands.add_parser("measure")
    run.add_argument("suite")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--only", help="comma-separated configuration ids")
    run.add_argument("--timeout", type=float, default=TIMEOUT_SECONDS)
    cap = commands.add_parser("capped")
    cap.add_argument("--out", type=Path, required=True)
    cap.add_argument("--timeout", type=float, default=TIMEOUT_SECONDS)
    guess = commands.add_parser("predict")
    guess.add_argument("suite")
    guess.add_argument("--gpu", required=True)
    guess.add_argument("--out", type=Path, required=True)
    guess.add_argument("--only", help="comma-separated configuration ids")
    join = commands.add_parser("merge")
    join.add_argument("predicted", type=Path)
    join.add_argument("measured", type=Path)
    join.add_argument("environment", type=Path)
    join.add_argument("--out", type=Path, required=True)
    commands.add_parser("predict-capped", help="capped-runs.json's predictions, made anew (no GPU)")
    render = commands.add_parser("table")
    render.add_argument("results", type=Path)
    render.add_argument("--write", type=Path, help="the markdown file whose marked block gets the table")
    arguments = parser.parse_args()
    if arguments.command == "environment":
        environment(arguments.out)
    elif arguments.command == "measure":
        only = set(arguments.only.split(",")) if arguments.only else None
        measure_suite(arguments.suite, arguments.out, only, arguments.timeout)
    elif arguments.command == "table":
        if arguments.write:
            write_table(arguments.results, arguments.write)
        else:
            print(table(arguments.results))
    elif arguments.command == "merge":
        merge(arguments.predicted, arguments.measured, arguments.environment, arguments.out)
    elif arguments.command == "predict-capped":
        predict_capped()
    elif arguments.command == "predict":
        only = set(arguments.only.split(",")) if arguments.only else None
        predict(arguments.suite, arguments.gpu, arguments.out, only)
    else:
        capped(arguments.out, arguments.timeout)


if __name__ == "__main__":
    main()
