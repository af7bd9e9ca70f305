"""Errors in the caller's terms: keywords for a Python caller, flags on the command line (memplan.api_terms)."""

import inspect
import json

import click
import pytest
from click.testing import CliRunner

import memplan
import memplan.api
from memplan.api_terms import in_api_terms
from memplan.cli import main
from memplan.settings import TrainingSettings

TINY = {"device": "cpu", "seq_len": 32}


@pytest.mark.parametrize(
    ("message", "worded"),
    [
        ("--batch-sizes takes positive integers, e.g. 1,2,4,8", "batch_sizes takes positive integers, e.g. 1,2,4,8"),
        ("give --world-size 2 instead of --gpus 2", "give world_size=2 instead of gpus=2"),
        ("pass --budget (e.g. 24GiB) or --gpu NAME", "pass budget (e.g. 24GiB) or gpu=NAME"),
        ("use it with --device cuda", "use it with device='cuda'"),
        ("--gpu T4 has 15.00 GiB", "gpu='T4' has 15.00 GiB"),
        ("try --budget 24GiB.", "try budget='24GiB'."),
        ("--gpus must be a positive integer, got 1.5", "gpus must be a positive integer, got 1.5"),
        ("for --step 'mod:fn' (no module)", "for step='mod:fn' (no module)"),
        ("'all' is a --checkpoint mode", "'all' is a checkpoint mode"),  # 'mode' is no --checkpoint value
        ("--checkpoint all or --precision amp-bf16", "checkpoint='all' or precision='amp-bf16'"),
        ("--lora RANK (train adapters)", "lora_rank=RANK (train adapters)"),
        ("--timeout must be positive", "timeout_s must be positive"),
        ("--cudnn-workspace-cap 64", "cudnn_workspace_cap_mib=64"),
        ("--deepspeed ds.json", "deepspeed_config ds.json"),
        (
            "pass --resume to continue it, --force to start it over",
            "pass resume=True to continue it, replace=True to start it over",
        ),
        ("--no-cudnn-tf32 and --cudnn-benchmark", "cudnn_allow_tf32=False and cudnn_benchmark=True"),
        ("--maximize-batch ranks by time", "plan_batch ranks by time"),
        # flags without a keyword stay as they are, and so does what only looks like a flag
        ("write it with --plot or --json", "write it with --plot or --json"),
        ("cannot read --hf-args a.json", "cannot read TrainingArguments file a.json"),
        ("torchrun --nproc-per-node 8; a--b; x --", "torchrun --nproc-per-node 8; a--b; x --"),
    ],
)
def test_a_message_names_the_keywords_a_python_caller_passes(message, worded):
    assert in_api_terms(message) == worded


# Options of the command line that no API function takes: each says so here, and every other option must come
# out of the rewording as a keyword of the function its command calls or of TrainingSettings.
# --force replaces output files, which the API does not write (validate_suite's replace=True: checked above).
CLI_ONLY = {"--json", "--debug", "--quiet", "--no-cache", "--plot", "--hf-args", "--output", "--suite", "--force"}
FUNCTIONS_OF = {
    "estimate": ("estimate", "which_gpu"),
    "sweep": ("sweep",),
    "compare": ("compare",),
    "plan": ("plan", "plan_batch"),
    "validate": ("validate", "validate_suite"),
}
CLI_ONLY_OF = {"estimate": {"--snapshot"}}  # the predicted snapshot file: the API returns the result instead


@pytest.mark.parametrize("command", sorted(FUNCTIONS_OF))
def test_every_option_of_a_command_has_its_keyword(command):
    keywords = set(TrainingSettings.__dataclass_fields__)
    for name in FUNCTIONS_OF[command]:
        keywords |= set(inspect.signature(getattr(memplan.api, name)).parameters)
    missed = []
    for option in main.commands[command].params:
        if not isinstance(option, click.Option):
            continue
        for flag in (*option.opts, *option.secondary_opts):
            if not flag.startswith("--") or flag in CLI_ONLY | CLI_ONLY_OF.get(command, set()):
                continue
            if flag == "--maximize-batch":  # a function of its own
                assert in_api_terms(flag) == "plan_batch"
                continue
            worded = in_api_terms(f"{flag} 5")
            keyword = worded.split("=")[0].split(" ")[0]
            if keyword not in keywords:
                missed.append(f"{flag} -> {worded}")
    assert not missed


def test_an_api_mistake_names_keywords_and_the_same_on_the_command_line_names_flags():
    with pytest.raises(memplan.MemplanError) as raised:
        memplan.compare("tiny-gpt2", gpus=0, **TINY)
    assert str(raised.value) == "gpus must be a positive integer, got 0"
    result = CliRunner().invoke(main, ["compare", "tiny-gpt2", "--gpus", "0", "--device", "cpu", "--seq-len", "32"])
    assert result.exit_code == 2 and "--gpus must be a positive integer, got 0" in result.output
    # and the command line's terms end with its command: the next Python call is worded for Python again
    with pytest.raises(memplan.MemplanError) as raised:
        memplan.sweep("tiny-gpt2", batch_sizes=(0,), **TINY)
    assert str(raised.value) == "batch_sizes takes positive integers, e.g. 1,2,4,8"


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        ({"batch_sizes": "1,,2"}, "batch_sizes takes integers"),
        ({"batch_sizes": ","}, "batch_sizes takes integers"),
        ({"batch_sizes": (1,), "precisions": "fp32,,bf16"}, "precisions has an empty name between its commas"),
        ({"batch_sizes": (1,), "checkpoints": "none,"}, "checkpoints has an empty name between its commas"),
    ],
)
def test_an_empty_entry_in_an_api_list_is_refused_as_the_cli_refuses_it(arguments, words):
    with pytest.raises(memplan.MemplanError, match=words):
        memplan.sweep("tiny-gpt2", **arguments, **TINY)


def test_lora_targets_may_be_a_list_of_names():
    listed = memplan.estimate("tiny-gpt2", lora_rank=4, lora_targets=["c_attn", "c_proj"], **TINY)
    joined = memplan.estimate("tiny-gpt2", lora_rank=4, lora_targets="c_attn,c_proj", **TINY)
    assert listed.settings.lora_targets == "c_attn,c_proj"
    assert listed.peak_bytes == joined.peak_bytes
    assert listed.trainable_parameter_count == joined.trainable_parameter_count


def test_an_estimate_s_notes_name_keywords_from_python_and_flags_on_the_command_line():
    result = memplan.estimate("tiny-gpt2", seq_len=32, gpu="A100-40GB")
    context = next(note for note in result.notes if "CUDA context" in note)
    assert context.endswith("give yours with cuda_context") and "--" not in context
    shown = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "--seq-len", "32", "--gpu", "A100-40GB", "--json"])
    assert shown.exit_code == 0, shown.output
    assert any(note.endswith("give yours with --cuda-context") for note in json.loads(shown.stdout)["notes"])
    # and so do the estimates inside another result: which_gpu's, card by card
    for option in memplan.which_gpu("tiny-gpt2", "T4,L4", seq_len=32, batch_size=2).options:
        context = next(note for note in option.estimate.notes if "CUDA context" in note)
        assert context.endswith("give yours with cuda_context"), context


def test_calls_from_two_threads_at_once_give_the_figures_of_calls_one_after_the_other():
    """A trace holds process-wide state: two estimates in two threads at once gave one of them other figures
    (tiny-llama's graph 625 nodes instead of 727). They wait for each other now."""
    import threading

    calls = {
        "gpt2": lambda: memplan.estimate("tiny-gpt2", **TINY),
        "llama": lambda: memplan.estimate("tiny-llama", batch_size=3, **TINY),
    }
    alone = {name: call().to_dict() for name, call in calls.items()}
    together = {}
    threads = [
        threading.Thread(target=lambda n=name, c=call: together.update({n: c().to_dict()}))
        for name, call in calls.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in (*alone.values(), *together.values()):
        result.pop("seconds")
    assert together == alone


def test_api_calls_from_threads_never_overlap():
    """The mechanism behind the test above, deterministically: each call holds the process's one API lock."""
    import threading
    import time

    from memplan.api_terms import speaks_api_terms

    events = []

    @speaks_api_terms
    def call(name: str) -> None:
        events.append(("in", name))
        time.sleep(0.2)
        events.append(("out", name))

    threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [kind for kind, _ in events] == ["in", "out", "in", "out"]
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1]


def test_numpy_numbers_are_the_numbers_they_hold():
    """A loop over np.arange or a pandas column gives numpy integers: refused as "batch size must be a positive
    integer, got np.int64(2)"; their estimate is the one of Python's ints."""
    import numpy as np

    plain = memplan.api.estimate("tiny-gpt2", batch_size=2, seq_len=16, device="cpu")
    given = memplan.api.estimate("tiny-gpt2", batch_size=np.int64(2), seq_len=np.int32(16), device="cpu")
    assert given.peak_bytes == plain.peak_bytes and given.settings.batch_size == 2
    assert type(given.settings.batch_size) is int
    swept = memplan.api.sweep("tiny-gpt2", batch_sizes=np.arange(1, 3), seq_len=16, device="cpu")
    assert [point.batch_size for point in swept.series[0].points] == [1, 2]
    with pytest.raises(memplan.MemplanError, match="batch size must be a positive integer"):
        memplan.api.estimate("tiny-gpt2", batch_size=np.float64(2.0), seq_len=16, device="cpu")


def test_an_empty_gpu_name_is_named_as_its_reader_gave_it():
    """`--gpu T4,,L4` was told "gpus has an empty name": which_gpu's keyword, not the flag typed."""
    typed = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "-b", "2", "--seq-len", "16", "--gpu", "T4,,L4"])
    assert typed.exit_code == 2 and "--gpu has an empty name between its commas" in typed.output
    with pytest.raises(memplan.MemplanError, match="^gpus has an empty name between its commas"):
        memplan.api.which_gpu("tiny-gpt2", gpus="T4,,L4", batch_size=2, seq_len=16)
