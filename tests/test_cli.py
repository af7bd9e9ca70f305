"""The CLI end to end: JSON output, and one-line errors with the right exit codes."""

import json

import pytest
from click.testing import CliRunner

from memplan.api_arguments import budget_in_bytes as api_budget
from memplan.cli import main
from memplan.settings import TrainingSettings


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_estimate_json_has_the_documented_fields(tiny_model_dirs):
    result = run(
        "estimate", tiny_model_dirs["gpt2"], "--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--json"
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert isinstance(data["peak_bytes"], int)
    assert set(data["breakdown"]) == {
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "temporaries",
        "inputs",
        "workspaces",
        "communication",
        "unsharded_parameters",
    }
    assert data["breakdown"]["workspaces"] == 0  # cuBLAS workspaces exist on cuda targets only
    assert data["breakdown"]["communication"] == 0  # DDP's buckets exist with --parallel ddp only
    assert data["breakdown"]["unsharded_parameters"] == 0  # FSDP2's, with --parallel fsdp only
    assert sum(data["breakdown"].values()) == data["peak_bytes"]
    assert data["phase"] in ("forward", "backward", "optimizer")
    assert data["settings"]["batch_size"] == 2 and data["settings"]["seq_len"] == 32
    # AdamW in fp32: exp_avg + exp_avg_sq = 2x the parameters, plus a 4-byte step counter per tensor
    parameters, state = data["breakdown"]["parameters"], data["breakdown"]["optimizer_state"]
    assert 0 <= state - 2 * parameters <= 4 * 64
    assert data["per_sample_activation_bytes"] > 0


def test_budget_gives_the_largest_batch_that_fits(tiny_model_dirs):
    model = tiny_model_dirs["gpt2"]
    base = ["estimate", model, "--seq-len", "32", "--device", "cpu", "--json"]
    one = json.loads(run(*base, "--batch-size", "1").stdout)
    budget = one["fixed_bytes"] + 7 * one["per_sample_activation_bytes"] + one["per_sample_activation_bytes"] // 2
    result = run(*base, "--batch-size", "2", "--budget", str(budget))
    assert result.exit_code == 0, result.output
    best = json.loads(result.stdout)["max_batch_size"]
    at_best = json.loads(run(*base, "--batch-size", str(best)).stdout)["peak_bytes"]
    above = json.loads(run(*base, "--batch-size", str(best + 1)).stdout)["peak_bytes"]
    assert at_best <= budget < above


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["estimate", "gtp2"], 2, "did you mean gpt2"),
        (["estimate", "gpt2", "--budget", "12 parsecs"], 2, "cannot read '12 parsecs' as a size"),
        (["estimate", "gpt2", "--batch-size", "0"], 2, "batch size must be a positive integer"),
        (["estimate", "gpt2", "--grad-accum", "-1"], 2, "gradient accumulation steps must be a positive integer"),
        (["estimate", "gpt2", "--seq-len", "4096"], 2, "longer than the model's maximum of 1024"),
        (["estimate", "no_such_pkg.models:build", "--inputs", "x.y:z"], 2, "cannot import module 'no_such_pkg.models'"),
        (["estimate", "tests.zoo_models:conv_bn_net"], 2, "pass --inputs"),
        (
            ["estimate", "tests.zoo_models:conv_bn_net", "--inputs", "tests.zoo_models:inputs_without_batch_size"],
            2,
            "must take one argument, the batch size",
        ),
        (
            [
                "estimate",
                "tests.zoo_models:reused_block",
                "--inputs",
                "tests.zoo_models:features_inputs",
                "--device",
                "cpu",
            ],
            2,
            "not a scalar loss; pass --loss",
        ),
        (
            [
                "estimate",
                "tests.zoo_models:data_dependent",
                "--inputs",
                "tests.zoo_models:features_inputs",
                "--device",
                "cpu",
            ],
            1,
            "aten._local_scalar_dense.default in module DataDependent depends on tensor values",
        ),
    ],
)
def test_user_errors_are_one_line_with_exit_codes(args, code, message):
    result = run(*args)
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback():
    result = CliRunner().invoke(main, ["estimate", "gtp2", "--debug"])
    assert result.exit_code == 2
    assert "Traceback" in result.output


def test_presets_lists_every_shipped_preset():
    result = run("presets")
    assert result.exit_code == 0
    for name in [
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "bert-base-uncased",
        "bert-large-uncased",
        "distilbert-base-uncased",
        "t5-small",
        "t5-base",
        "llama-2-7b",
        "llama-3-8b",
        "mistral-7b",
        "qwen2.5-0.5b",
        "vit-base-patch16-224",
        "resnet-50",
        "resnet-101",
    ]:
        assert name in result.output


def test_api_rejects_unknown_settings():
    import memplan
    from memplan.errors import SettingsError

    with pytest.raises(SettingsError, match="unknown setting"):
        memplan.estimate("gpt2", batch_sise=4)


def _deep_gpt2(tmp_path):
    from tests.zoo import TINY_HF_CONFIGS

    folder = tmp_path / "gpt2-deep"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_HF_CONFIGS["gpt2"], "n_layer": 4}))
    return str(folder)


def test_plan_jobs_one_process_gives_the_same_plan(tmp_path):
    common = ["plan", _deep_gpt2(tmp_path), "-b", "2", "--seq-len", "32", "--device", "cpu", "--budget", "9MiB"]
    runner = CliRunner()
    alone = runner.invoke(main, [*common, "--jobs", "1", "--json"])
    default = runner.invoke(main, [*common, "--json"])
    assert alone.exit_code == 0 and default.exit_code == 0, alone.output + default.output
    assert json.loads(alone.stdout)["layout"] == json.loads(default.stdout)["layout"]
    assert json.loads(alone.stdout)["baselines"] == json.loads(default.stdout)["baselines"]
    zero = runner.invoke(main, [*common, "--jobs", "0"])
    assert zero.exit_code == 2 and "--jobs" in zero.output


def test_plan_json_and_plan_file_round_trip(tmp_path, measure_in_this_process):
    model = _deep_gpt2(tmp_path)
    common = [model, "-b", "2", "--seq-len", "32", "--device", "cpu"]
    plan_path = tmp_path / "plan.json"
    runner = CliRunner()
    result = runner.invoke(main, ["plan", *common, "--budget", "9MiB", "--json", "-o", str(plan_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"fits", "predicted_peak_bytes", "recompute_flops", "baselines"} <= set(data)
    assert {b["name"] for b in data["baselines"]} == {"none", "all blocks", "sqrt(n) segments", "every 2nd block"}
    assert all({"name", "fits", "predicted_peak_bytes", "recompute_flops"} <= set(b) for b in data["baselines"])

    estimated = runner.invoke(main, ["estimate", *common, "--checkpoint", str(plan_path), "--json"])
    assert estimated.exit_code == 0, estimated.output
    assert json.loads(estimated.stdout)["peak_bytes"] == data["predicted_peak_bytes"]

    # validate --checkpoint plan.json: the plan applied to a real run, measured within budget.
    validated = runner.invoke(main, ["validate", *common, "--checkpoint", str(plan_path), "--json"])
    assert validated.exit_code == 0, validated.output
    measured = json.loads(validated.stdout)
    assert measured["predicted_peak_bytes"] == data["predicted_peak_bytes"]
    assert measured["measured_peak_bytes"] <= 9 * 2**20 and abs(measured["relative_error"]) <= 0.005

    other_settings = runner.invoke(main, ["estimate", *common[:2], "4", *common[3:], "--checkpoint", str(plan_path)])
    assert other_settings.exit_code == 2
    assert "batch_size 2 in the plan, 4 here" in other_settings.output

    not_a_plan = tmp_path / "other.json"
    not_a_plan.write_text("{}")
    refused = runner.invoke(main, ["estimate", *common, "--checkpoint", str(not_a_plan)])
    assert refused.exit_code == 2 and "not a memplan checkpoint plan" in refused.output


def test_cuda_budgets_hold_the_memory_the_step_completes_in():
    """Between the allocated peak and the least memory the step completes in it does not fit: the
    allocator needs its segments, even after freeing every cached one. The largest batch is the
    last one whose step, replayed on a device of the budget's size, completes."""
    from memplan.api import estimate

    settings = {"batch_size": 4, "seq_len": 64}
    unbounded = estimate("tiny-gpt2", **settings)
    assert unbounded.reserved_peak_bytes >= unbounded.smallest_device_bytes > unbounded.peak_bytes
    between = (unbounded.peak_bytes + unbounded.smallest_device_bytes) // 2
    result = estimate("tiny-gpt2", budget=between, **settings)
    assert result.fits is False
    largest = result.max_batch_size
    assert estimate("tiny-gpt2", **{**settings, "batch_size": largest}).fits_within(between)
    assert not estimate("tiny-gpt2", **{**settings, "batch_size": largest + 1}).fits_within(between)
    assert estimate("tiny-gpt2", budget=unbounded.smallest_device_bytes, **settings).fits is True


def test_cuda_context_is_the_users_when_given(tiny_model_dirs):
    model = tiny_model_dirs["gpt2"]
    common = ("estimate", model, "-b", "2", "--seq-len", "32", "--json")
    given = json.loads(run(*common, "--cuda-context", "700MiB").stdout)
    assert given["device_peak_bytes"] - given["reserved_peak_bytes"] == 700 * 2**20
    none = json.loads(run(*common, "--cuda-context", "0").stdout)  # e.g. for a figure torch.cuda reports alone
    assert none["device_peak_bytes"] == none["reserved_peak_bytes"]
    # A GPU's budget is its memory less the context: the A10G's 23,028 MiB less 700 MiB.
    settings = TrainingSettings(gpu="A10G", cuda_context=700 * 2**20)
    assert api_budget(None, settings) == 23028 * 2**20 - 700 * 2**20
    default = json.loads(run(*common).stdout)
    # 767 MiB: the main suite's median of device - reserved on the lent H100 (measured-main.json).
    assert default["device_peak_bytes"] - default["reserved_peak_bytes"] == 767 * 2**20
    assert any("--cuda-context" in note for note in default["notes"])
    refused = run("estimate", model, "--device", "cpu", "--cuda-context", "1GiB")
    assert refused.exit_code == 2 and "no meaning with --device cpu" in refused.output


def test_ctrl_c_stops_a_long_search_promptly_with_exit_130():
    import os
    import resource
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    # gpt2-large: a search of several 36-block traces, ~20 s on a fast 2-core machine. The signal goes
    # once the process has spent 4 s of CPU (start-up is ~2.7 s), so a faster or slower machine moves
    # both ends alike instead of a wall-clock sleep racing the search.
    command = [sys.executable, "-m", "memplan", "estimate", "gpt2-large", "-b", "8", "--seq-len", "1024"]
    process = subprocess.Popen(
        [*command, "--budget", "1TiB"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu_seconds() -> float:
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    while process.poll() is None and cpu_seconds() < 4.0:
        time.sleep(0.1)
    assert process.poll() is None, "finished before it could be interrupted"
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_at_signal = cpu_seconds()
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    stopped_after = time.monotonic() - sent
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the process, reaped, is counted now
    cpu_total = (children_after.ru_utime - children_before.ru_utime) + (
        children_after.ru_stime - children_before.ru_stime
    )
    assert process.returncode == 130, (process.returncode, stderr.decode()[-3000:])
    assert stderr.decode().strip().endswith("memplan: interrupted")
    # Promptly: the CPU it spent after the signal, which other processes sharing the cores (pytest -n)
    # do not stretch as they stretch the wall clock; the wall clock only bounds a hang.
    # What it finishes before it stops, and the exit's teardown: 3.3 s once on the 2-core machine with another
    # pytest beside it (2026-12-06; under 3 s alone); a search that went on would spend its remaining traces, over
    # 10 s more.
    cpu_after_signal = cpu_total - cpu_at_signal
    assert cpu_after_signal < 6, f"spent {cpu_after_signal:.1f} s of CPU after the signal"
    assert stopped_after < 20, f"took {stopped_after:.1f} s to stop"


def test_a_long_command_reports_progress_on_stderr_when_piped_and_keeps_stdout_json():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "memplan", "estimate", "tiny-gpt2", "-b", "8", "--seq-len", "128"]
    done = subprocess.run(
        [*command, "--budget", "256MiB", "--json"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "MEMPLAN_PROGRESS_AFTER_SECONDS": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["max_batch_size"] > 8  # stdout is the JSON alone
    progress = [line for line in done.stderr.splitlines() if line.startswith("memplan: tracing batch size")]
    assert [line.split("(trace ")[1] for line in progress][:2] == ["1)", "2)"]  # what it does, and how far


def test_cuda_library_switches_come_from_flags_or_their_environment_variables(tiny_model_dirs):
    model = tiny_model_dirs["gpt2"]
    common = ("estimate", model, "-b", "2", "--seq-len", "32", "--gpu", "A100-80GB", "--json")
    default = json.loads(run(*common).stdout)
    # Two cuBLAS workspaces (the forward thread and autograd's), each :16:8 = 128 KiB instead of 8.125 MiB.
    small = json.loads(run(*common, "--cublas-workspace-config", ":16:8").stdout)
    assert small["settings"]["cublas_workspace_config"] == ":16:8"
    saved = 2 * (4096 * 1024 * 2 + 16 * 1024 * 8 - 16 * 1024 * 8)
    assert default["peak_bytes"] - small["peak_bytes"] == saved
    from_environment = CliRunner().invoke(main, list(common), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert json.loads(from_environment.stdout)["peak_bytes"] == small["peak_bytes"]
    text = CliRunner().invoke(main, list(common[:-1]), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert "from the environment: CUBLAS_WORKSPACE_CONFIG=:16:8" in text.stderr
    # A CUDA variable in the environment means nothing for a cpu target; a flag given for one is refused.
    cpu = CliRunner().invoke(
        main,
        ["estimate", model, "-b", "2", "--seq-len", "32", "--device", "cpu", "--json"],
        env={"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUDNN_CONV_WSCAP_DBG": "64"},
    )
    assert cpu.exit_code == 0 and json.loads(cpu.stdout)["settings"]["cublas_workspace_config"] is None
    refused = run("estimate", model, "--device", "cpu", "--cudnn-benchmark")
    assert refused.exit_code == 2 and "--cudnn-benchmark configures a CUDA library" in refused.output
    unreadable = run(*common, "--cublas-workspace-config", "4096:8")
    assert unreadable.exit_code == 2 and "cannot read CUBLAS_WORKSPACE_CONFIG '4096:8'" in unreadable.output
    deterministic = json.loads(run(*common, "--deterministic").stdout)
    assert any("CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8" in note for note in deterministic["notes"])


def test_the_allocator_configuration_comes_from_the_flag_or_pytorch_cuda_alloc_conf(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["gpt2"]
    common = ["estimate", model, "-b", "2", "--seq-len", "32", "--json"]
    default = json.loads(run(*common).stdout)
    expandable = CliRunner().invoke(main, common, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    data = json.loads(expandable.stdout)
    assert data["settings"]["cuda_alloc_conf"] == "expandable_segments:True"
    assert data["peak_bytes"] == default["peak_bytes"] and data["reserved_peak_bytes"] != default["reserved_peak_bytes"]
    assert any("expandable_segments:True" in note for note in data["notes"])
    # torch 2.11+ reads PYTORCH_ALLOC_CONF where PYTORCH_CUDA_ALLOC_CONF is unset (CUDAAllocatorConfig.h)
    newer = CliRunner().invoke(main, common, env={"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert json.loads(newer.stdout)["reserved_peak_bytes"] == data["reserved_peak_bytes"]
    both = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert (
        json.loads(CliRunner().invoke(main, common, env=both).stdout)["reserved_peak_bytes"]
        == default["reserved_peak_bytes"]
    )
    noted = json.loads(run(*common, "--cuda-alloc-conf", "backend:cudaMallocAsync,max_split_size_mb:64").stdout)
    assert noted["reserved_peak_bytes"] == default["reserved_peak_bytes"]  # no block of this step reaches 64 MiB
    assert [note for note in noted["notes"] if "not modelled" in note] == [
        "PYTORCH_CUDA_ALLOC_CONF backend, max_split_size_mb (ignored under backend:cudaMallocAsync, as torch ignores "
        "it): not modelled; reserved_peak_bytes follows the allocator's default rules for them"
    ]
    # torch ignores the native allocator's options under cudaMallocAsync (CUDAAllocatorConfig::parseArgs): so does
    # memplan, where expandable segments had set reserved_peak_bytes (and said so beside the backend's note)
    asynchronous = json.loads(
        run(*common, "--cuda-alloc-conf", "backend:cudaMallocAsync,expandable_segments:True").stdout
    )
    assert asynchronous["reserved_peak_bytes"] == default["reserved_peak_bytes"]
    assert not any(note.startswith("expandable_segments:True") for note in asynchronous["notes"])
    # per_process_memory_fraction caps the allocator at that share of the card (setMemoryFraction): a T4's
    # 15,360 MiB x 0.3, where the card alone leaves it 15,360 MiB less the 767 MiB context
    on_t4 = [*common, "--gpu", "T4"]
    assert json.loads(run(*on_t4).stdout)["budget_bytes"] == (15360 - 767) * 2**20
    capped = json.loads(run(*on_t4, "--cuda-alloc-conf", "per_process_memory_fraction:0.3").stdout)
    assert capped["budget_bytes"] == int(0.3 * 15360 * 2**20)
    assert any("judged against it on the T4" in note for note in capped["notes"])
    nothing = run(*on_t4, "--cuda-alloc-conf", "per_process_memory_fraction:0")  # had blamed the CUDA context
    assert nothing.exit_code == 2 and "per_process_memory_fraction:0 leaves torch's allocator nothing" in nothing.output
    collected = json.loads(run(*common, "--cuda-alloc-conf", "garbage_collection_threshold:0.8").stdout)
    assert collected["reserved_peak_bytes"] == default["reserved_peak_bytes"]
    assert any("set_per_process_memory_fraction" in note for note in collected["notes"])
    # roundup_power2_divisions:16 rounds requests above 8 KiB to sixteenths of their power of two,
    # and memory_allocated counts each request as its rounded block: batch 3 x 30 tokens makes
    # sizes that are not already multiples of those steps (this tiny model's are powers of two).
    odd = ["estimate", model, "-b", "3", "--seq-len", "30", "--json"]
    divided = json.loads(run(*odd, "--cuda-alloc-conf", "roundup_power2_divisions:16").stdout)
    assert divided["peak_bytes"] > json.loads(run(*odd).stdout)["peak_bytes"]
    unknown = run(*common, "--cuda-alloc-conf", "expandable:True")
    assert unknown.exit_code == 2 and "unknown option 'expandable'" in unknown.output
    snapshot = run(*common, "--cuda-alloc-conf", "expandable_segments: True", "--snapshot", str(tmp_path / "s.pickle"))
    assert snapshot.exit_code == 2 and "not expandable segments" in snapshot.output
    assert not (tmp_path / "s.pickle").exists()


def test_an_error_raised_while_ctrl_c_unwinds_the_work_is_reported_as_the_interrupt(capsys):
    import os
    import signal

    from memplan.cli.running import _run

    def action() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises KeyboardInterrupt here
        finally:
            raise RuntimeError("cleanup failed on half-done state")  # replaces it, as a finally can

    with pytest.raises(SystemExit) as stopped:
        _run(False, action)
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip() == "memplan: interrupted"

    def failing() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(SystemExit) as stopped:  # the next command starts clean
        _run(False, failing)
    assert stopped.value.code == 1 and "internal error: RuntimeError: a bug" in capsys.readouterr().err


def test_an_internal_error_asks_for_debug_only_without_it(capsys):
    from memplan.cli.running import _run

    def failing() -> None:
        raise RuntimeError("a bug")

    for debug, advice in ((False, True), (True, False)):
        with pytest.raises(SystemExit):
            _run(debug, failing)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("memplan: internal error: RuntimeError: a bug")
        assert ("(rerun with --debug)" in last) is advice


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_progress_delay_that_is_no_number_of_seconds_is_one_line(monkeypatch, value):
    monkeypatch.setenv("MEMPLAN_PROGRESS_AFTER_SECONDS", value)
    result = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "--seq-len", "16", "--device", "cpu", "--no-cache"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"memplan: error: MEMPLAN_PROGRESS_AFTER_SECONDS={value!r} is not a number of seconds; give one, such as 3"
    )


def test_bitsandbytes_import_warnings_about_this_machine_are_kept_off_stderr(caplog):
    """bitsandbytes warns on import, where the CPU has AVX-512 BF16, that its CPU kernel package is missing: every
    --hf-args command printed it, under -q too. Its other messages still show."""
    import logging

    from memplan.cli.running import _run

    _run(False, lambda: None)
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        cpu_ops.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module named 'kernels'")
        cpu_ops.warning("a warning about the user's own job")
    assert [record.getMessage() for record in caplog.records] == ["a warning about the user's own job"]


def test_a_close_name_is_suggested_once():
    """A model type that is also a preset's name came twice ("did you mean gpt2, gpt2, ...")."""
    from memplan.models.source import _suggest

    names = _suggest("gtp2").removeprefix("did you mean ").removesuffix("? ").split(", ")
    assert "gpt2" in names and len(names) == len(set(names))


@pytest.mark.parametrize(
    ("args", "code", "shown"),
    [
        (["--version"], 0, "memplan, version"),
        (["estimate", "-h"], 0, "Usage:"),
        ([], None, "Commands:"),  # `memplan` alone: its help, with click's own exit code
    ],
)
def test_help_version_and_a_bare_command_pass_through_the_one_line_errors(args, code, shown):
    """memplan.cli prints click's usage errors in one line; what click answers otherwise is unchanged."""
    import click

    result = CliRunner().invoke(main, args)
    assert shown in result.output, result.output
    no_args = getattr(click.exceptions, "NoArgsIsHelpError", None)
    expected = code if code is not None else (no_args.exit_code if no_args else 0)
    assert result.exit_code == expected and "memplan: error" not in result.output


def test_sweep_s_help_lists_no_batch_size_which_it_refuses():
    """--batch-sizes replaces the training options' --batch-size in sweep, which refuses it: its help (and so
    docs/cli.md) had listed `-b, --batch-size [default: 1]` (CLI bug hunt)."""
    shown = run("sweep", "--help")
    assert shown.exit_code == 0 and "--batch-sizes" in shown.output and "-b, --batch-size" not in shown.output
    refused = run("sweep", "tiny-gpt2", "-b", "3", "--device", "cpu")
    assert refused.exit_code == 2 and "sweep traces --batch-sizes" in refused.output
