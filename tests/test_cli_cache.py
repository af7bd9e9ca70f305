"""memplan's answer cache (memplan.cli.cache): a repeated command prints what it printed before
without tracing, and anything that could change the answer traces again.

Traces are counted by wrapping the tracer the estimator calls, so "answered from the cache" is
checked as "printed the same and traced nothing", not taken from the cache's own word."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import memplan.cli.cache as cache_module
import memplan.estimator.batch_tracer as estimator
from memplan.cli import main
from memplan.cli.cache import ANSWER_PREFIX, _evict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache on, in a folder of its own; the number of traces run so far in `traces[0]`."""
    monkeypatch.delenv("MEMPLAN_NO_CACHE", raising=False)
    folder = tmp_path / "nested" / "cache"  # made with its parents
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(folder))
    traces = [0]
    trace_step = estimator.trace_step

    def counted(*args, **kwargs):
        traces[0] += 1
        return trace_step(*args, **kwargs)

    monkeypatch.setattr(estimator, "trace_step", counted)
    return folder, traces


def _estimate(*arguments: str):
    result = CliRunner().invoke(main, ["estimate", *arguments, "--device", "cpu", "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    return result


def test_a_repeated_estimate_is_answered_without_tracing(cache, tiny_model_dirs):
    folder, traces = cache
    first = _estimate(tiny_model_dirs["gpt2"], "-b", "2")
    traced = traces[0]
    assert traced >= 1
    second = _estimate(tiny_model_dirs["gpt2"], "-b", "2")
    assert traces[0] == traced  # nothing traced
    assert second.stdout == first.stdout
    assert "answered from the cache" in second.stderr
    assert len(list(folder.glob("*.json"))) == 1


def test_what_could_change_the_answer_traces_again(cache, tiny_model_dirs, tmp_path, monkeypatch):
    """One change at a time, each undone before the next: each traces, and the unchanged command
    after them all is still answered from the cache."""
    _, traces = cache
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((Path(tiny_model_dirs["gpt2"]) / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config))
    arguments = [str(model), "-b", "2"]
    _estimate(*arguments)

    def traced_again(*extra: str) -> None:
        before = traces[0]
        result = _estimate(*arguments, *extra)
        assert traces[0] > before and "answered from the cache" not in result.stderr

    traced_again("--precision", "bf16")  # an option
    traced_again("--json")  # how it is shown
    traced_again("--no-cache")
    real_version = cache_module._version
    with monkeypatch.context() as patched:  # an installed package's version
        patched.setattr(cache_module, "_version", lambda name: "0" if name == "transformers" else real_version(name))
        traced_again()
    (model / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    traced_again()  # the model's config
    (model / "config.json").write_text(json.dumps(config))
    with monkeypatch.context() as patched:
        patched.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
        traced_again()  # the allocator's configuration
        patched.setenv("MEMPLAN_NO_CACHE", "1")
        traced_again()
    before = traces[0]
    assert "answered from the cache" in _estimate(*arguments).stderr and traces[0] == before


def test_code_of_the_user_s_is_traced_every_time(cache):
    folder, traces = cache
    arguments = ["estimate", "tests.ddp_models:stack", "-b", "4", "--device", "cpu"]
    source = ["--inputs", "tests.ddp_models:rows", "--loss", "tests.ddp_models:mean_square"]
    counts = []
    for _ in range(2):
        result = CliRunner().invoke(main, [*arguments, *source])
        assert result.exit_code == 0, result.output
        assert "answered from the cache" not in result.stderr
        counts.append(traces[0])
    assert counts[1] > counts[0] > 0
    assert not folder.exists() or not list(folder.glob("*.json"))


def test_a_failed_command_is_not_kept_and_an_unreadable_answer_is_traced_again(cache, tiny_model_dirs):
    folder, traces = cache
    failed = CliRunner().invoke(main, ["estimate", tiny_model_dirs["gpt2"], "--device", "cpu", "--seq-len", "100000"])
    assert failed.exit_code != 0
    assert not folder.exists() or not list(folder.glob("*.json"))
    _estimate(tiny_model_dirs["gpt2"], "-b", "2")
    (answer,) = folder.glob("*.json")
    answer.write_text("{not json")
    before = traces[0]
    again = _estimate(tiny_model_dirs["gpt2"], "-b", "2")
    assert traces[0] > before and "answered from the cache" not in again.stderr
    assert json.loads(answer.read_text())["stdout"] == again.stdout  # kept again, whole


def _answer_name(digit: str) -> str:
    return f"{ANSWER_PREFIX}{digit * 64}.json"


def test_the_least_recently_used_answers_go_first_above_the_cap(tmp_path):
    old, middle, new = (_answer_name(digit) for digit in "abc")
    sizes = {old: 400, middle: 300, new: 200}
    for age, (name, size) in enumerate(sizes.items()):
        path = tmp_path / name
        path.write_text("x" * size)
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    _evict(tmp_path, 600)
    assert sorted(path.name for path in tmp_path.glob("*.json")) == [middle, new]
    _evict(tmp_path, 500)  # exactly the cap: kept
    assert len(list(tmp_path.glob("*.json"))) == 2
    _evict(tmp_path, 499)
    assert [path.name for path in tmp_path.glob("*.json")] == [new]


def test_files_of_the_user_s_own_in_the_cache_folder_are_never_counted_or_deleted(tmp_path):
    """MEMPLAN_CACHE_DIR pointed at a project folder: its 70 MB eval_results.json had been deleted as the least
    recently used "answer" once the folder's .json files passed the cap (a bug hunt)."""
    theirs = {"eval_results.json": 900, f"{ANSWER_PREFIX}notakey.json": 900, f"{'d' * 64}.json": 900}
    for name, size in theirs.items():
        (tmp_path / name).write_text("x" * size)
        os.utime(tmp_path / name, (1_000, 1_000))  # older than any answer
    answer = tmp_path / _answer_name("e")
    answer.write_text("x" * 100)
    _evict(tmp_path, 100)  # the answers alone are at the cap: nothing goes
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*theirs, answer.name])
    _evict(tmp_path, 99)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(theirs)


def test_a_damaged_answer_is_traced_again_and_replaced(cache, tiny_model_dirs):
    """`{"stdout": 5}` had raised a TypeError with a traceback on every run until the file was found and deleted."""
    folder, traces = cache
    first = _estimate(tiny_model_dirs["gpt2"], "-b", "2")
    (answer,) = folder.glob("*.json")
    answer.write_text(json.dumps({"stdout": 5}))
    before = traces[0]
    again = _estimate(tiny_model_dirs["gpt2"], "-b", "2")
    assert traces[0] > before and "answered from the cache" not in again.stderr
    assert again.stdout.splitlines()[:-1] == first.stdout.splitlines()[:-1]  # all but the time it took
    assert json.loads(answer.read_text())["stdout"] == again.stdout


def test_an_answer_from_the_cache_does_not_import_torch(tmp_path, tiny_model_dirs):
    """What makes it fast: the whole command, in a process of its own, never imports torch."""
    environment = {**os.environ, "MEMPLAN_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    environment.pop("MEMPLAN_NO_CACHE", None)
    arguments = ["estimate", tiny_model_dirs["gpt2"], "-b", "2", "--device", "cpu", "--seq-len", "16"]
    program = (
        "import sys\nfrom memplan.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)"
    )
    runs = [
        subprocess.run([sys.executable, "-c", program, *arguments], capture_output=True, text=True, env=environment)
        for _ in range(2)
    ]
    assert "torch imported" in runs[0].stderr
    assert "no torch" in runs[1].stderr and "answered from the cache" in runs[1].stderr
    assert runs[1].stdout == runs[0].stdout


def test_the_cache_lives_where_the_environment_says(tmp_path, monkeypatch):
    from memplan.cli.cache import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("MEMPLAN_CACHE_DIR", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "memplan"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "memplan"
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_memplan_s_own_source_is_part_of_the_key(tmp_path, monkeypatch):
    """Every .py and .json file, by path and content; compiled files are not source."""
    import memplan.cli.cache as cache

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "gpt2.json").write_text("{}")
    (tmp_path / "a.py").write_text("x = 1")
    (tmp_path / "__pycache__").mkdir()
    monkeypatch.setattr(cache, "_MEMPLAN_DIR", tmp_path)
    digests = [cache._memplan_source_digest()]
    (tmp_path / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "notes.txt").write_text("not source")
    digests.append(cache._memplan_source_digest())
    (tmp_path / "models" / "gpt2.json").write_text('{"n_layer": 2}')
    digests.append(cache._memplan_source_digest())
    (tmp_path / "a.py").rename(tmp_path / "b.py")
    digests.append(cache._memplan_source_digest())
    assert digests[0] == digests[1] and len(set(digests)) == 3


def test_which_models_are_kept_and_by_what(tmp_path, tiny_model_dirs):
    from memplan.cli.cache import _model_digest

    folder = Path(tiny_model_dirs["gpt2"])
    expected = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    assert _model_digest(str(folder)) == expected  # a model folder: its config.json
    assert _model_digest(str(folder / "config.json")) == expected
    assert _model_digest("gpt2") == "preset"
    assert _model_digest("tests.ddp_models:stack") is None  # code
    assert _model_digest("openai-community/gpt2") is None  # a hub id: Hugging Face's cache
    assert _model_digest(str(tmp_path / "missing")) is None


def test_files_the_answer_reads_and_variables_it_depends_on_are_in_the_key(
    cache, tiny_model_dirs, tmp_path, monkeypatch
):
    """An --hf-args file's content and a variable memplan reads itself (no option mirrors it) each
    trace again; a variable nothing reads does not."""
    _, traces = cache
    hf_args = tmp_path / "args.json"
    hf_args.write_text(json.dumps({"per_device_train_batch_size": 2}))
    arguments = [tiny_model_dirs["gpt2"], "--hf-args", str(hf_args)]
    _estimate(*arguments)

    def traces_for(*extra: str) -> int:
        before = traces[0]
        _estimate(*arguments, *extra)
        return traces[0] - before

    assert traces_for() == 0
    monkeypatch.setenv("SOMETHING_MEMPLAN_DOES_NOT_READ", "1")
    assert traces_for() == 0
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")  # read by the cuda target's SDPA choice
    assert traces_for() > 0
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    hf_args.write_text(json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}))
    assert traces_for() > 0


def test_the_deepspeed_file_an_hf_args_file_names_is_in_the_key(cache, tiny_model_dirs, tmp_path):
    """The Trainer's DeepSpeed configuration decides the answer as much as the arguments file that names it: a
    change to it alone is another answer (it was answered from the cache: 71 MB where a fresh trace said 169)."""
    deepspeed = tmp_path / "ds.json"
    hf_args = tmp_path / "args.json"
    hf_args.write_text(json.dumps({"per_device_train_batch_size": 2, "deepspeed": str(deepspeed)}))
    params = {"model": tiny_model_dirs["gpt2"], "hf_args": str(hf_args), "world_size": 2}

    def kept_at(bucket: int) -> Path:
        deepspeed.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": bucket}}))
        return cache_module.cached_answer("estimate", params).path

    assert kept_at(1_000_000) == kept_at(1_000_000)
    assert kept_at(50_000_000) != kept_at(1_000_000)


def test_a_flag_given_at_its_default_beside_hf_args_is_another_question(cache, tiny_model_dirs, tmp_path):
    """With --hf-args, `--precision fp32` given outright overrides the file's bf16 though fp32 is the default: it
    was answered from the cache with the file's amp-bf16 answer."""
    hf_args = tmp_path / "args.json"
    hf_args.write_text(json.dumps({"per_device_train_batch_size": 2, "bf16": True}))
    from_file = json.loads(_estimate(tiny_model_dirs["gpt2"], "--hf-args", str(hf_args), "--json").stdout)
    given = _estimate(tiny_model_dirs["gpt2"], "--hf-args", str(hf_args), "--precision", "fp32", "--json")
    assert "answered from the cache" not in given.stderr
    assert (from_file["settings"]["precision"], json.loads(given.stdout)["settings"]["precision"]) == (
        "amp-bf16",
        "fp32",
    )


def test_a_command_that_writes_a_file_is_not_kept(cache, tiny_model_dirs, tmp_path):
    folder, traces = cache
    model = tiny_model_dirs["gpt2"]
    _estimate(model, "-b", "2", "--plot", str(tmp_path / "step.png"))  # user code: the module:fn test below
    assert not folder.exists() or not list(folder.glob("*.json"))


def test_a_terminal_and_a_pipe_keep_their_own_answers(monkeypatch, tmp_path):
    """Tables are as wide as the terminal, and coloured there: the same command piped is another answer."""
    import io

    from memplan.cli.cache import cached_answer

    monkeypatch.delenv("MEMPLAN_NO_CACHE", raising=False)
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    params = {"model": "gpt2", "batch_size": 2}
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    piped = cached_answer("estimate", params).path
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert cached_answer("estimate", params).path != piped


def test_eviction_stops_as_soon_as_the_folder_is_under_the_cap(tmp_path):
    old, middle, new = (_answer_name(digit) for digit in "abc")
    for age, (name, size) in enumerate({old: 400, middle: 300, new: 200}.items()):
        path = tmp_path / name
        path.write_text("x" * size)
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    _evict(tmp_path, 250)  # 900 -> 500 -> 200: two go
    assert [path.name for path in tmp_path.glob("*.json")] == [new]
