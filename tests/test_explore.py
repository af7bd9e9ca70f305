"""sweep and compare: every number equals an estimate of the same settings; recompute FLOPs are independent."""

import json

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from memplan.api import compare, estimate, sweep
from memplan.cli import main
from memplan.estimator.batch_tracer import BatchTracer
from memplan.explore.sweep import run_sweep, tracing_order
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

BASE = {"seq_len": 32, "device": "cpu", "attn_impl": "eager"}


def test_sweep_points_and_largest_batches_match_estimates():
    """Every point and largest batch against a trace at that very batch size (one fake model per setting, as
    an estimate's own trace at its batch size: memplan.estimator.batch_tracer.BatchTracer)."""
    spec = resolve_model("tiny-gpt2")

    def traced(checkpoint: str):
        settings = spec.settings_for(TrainingSettings(batch_size=1, checkpoint=checkpoint, **BASE))
        tracer = BatchTracer(spec, settings)
        return lambda batch_size: tracer.simulate(batch_size).peak_bytes

    peak_of = {checkpoint: traced(checkpoint) for checkpoint in ("none", "all")}
    budget = estimate("tiny-gpt2", batch_size=6, **BASE).peak_bytes
    assert peak_of["none"](6) == budget
    result = sweep("tiny-gpt2", batch_sizes=(1, 4, 8), checkpoints=("none", "all"), budget=budget, **BASE)
    assert [s.label for s in result.series] == ["fp32", "fp32, checkpoint all"]
    for series in result.series:
        peak = peak_of[series.checkpoint]
        for point in series.points:
            assert point.peak_bytes == peak(point.batch_size)
            assert point.fits == (peak(point.batch_size) <= budget)
        largest = series.max_batch_size
        assert peak(largest) <= budget < peak(largest + 1)
    assert result.series[0].max_batch_size == 6
    assert result.series[1].max_batch_size > 6  # checkpointing every block fits a larger batch


def test_the_sweep_traces_from_the_ends_inwards():
    assert tracing_order((1, 2, 3, 4, 5, 7, 9)) == [1, 9, 2, 5, 3, 4, 7]  # 1, the ends above it, their middle
    assert tracing_order((16, 4, 8)) == [16, 4, 8]
    assert tracing_order((1, 2)) == [1, 2]


@pytest.mark.parametrize(
    ("model", "options", "batch_sizes", "traced"),
    [
        # cuda: batch 25's least device memory is 2 MiB under its reserved peak, both from the lines
        ("llama", dict(seq_len=64, gpu="A10G"), (1, 2, 9, 17, 25, 33), (1, 2, 17, 33)),
        ("gpt2", dict(seq_len=16, device="cpu"), (1, 2, 3, 5, 9), (1, 2, 5, 9)),
        # its step adds a layer above 6 samples: no lines, every batch size traced
        (
            "tests.zoo_models:wider_for_large_batches",
            dict(optimizer="sgd", gpu="A10G"),
            (1, 2, 3, 5, 9),
            (1, 2, 3, 5, 9),
        ),
    ],
)
def test_sweep_points_from_the_lines_equal_traces_of_their_batch_sizes(
    model, options, batch_sizes, traced, tiny_model_dirs
):
    """Each batch size the sweep answers from the lines, against a fresh tracer's own trace of it."""
    custom = model.startswith("tests.")
    spec = resolve_model(
        tiny_model_dirs.get(model, model), inputs="tests.zoo_models:features_inputs" if custom else None
    )
    settings = spec.settings_for(TrainingSettings(**options))
    fresh = BatchTracer(spec, settings)
    budget = fresh.simulate(batch_sizes[-2]).fit_bytes
    (series,) = run_sweep(spec, settings, batch_sizes=batch_sizes, budget_bytes=budget).series
    assert [point.batch_size for point in series.points] == list(batch_sizes)
    assert tuple(point.batch_size for point in series.points if point.traced) == traced
    for point in series.points:
        simulation = fresh.simulate(point.batch_size)
        assert (point.peak_bytes, point.reserved_peak_bytes, point.smallest_device_bytes) == (
            simulation.peak_bytes,
            simulation.reserved_peak_bytes,
            simulation.smallest_device_bytes,
        )
        assert point.fits == simulation.fits_within(budget) == (point.batch_size <= batch_sizes[-2])


def _block_forward_flops(batch_size: int) -> int:
    """FLOPs of one real forward of tiny-gpt2's blocks, counted by torch's FlopCounterMode per module."""
    spec = resolve_model("tiny-gpt2")
    settings = spec.settings_for(TrainingSettings(batch_size=batch_size, **BASE))
    torch.manual_seed(0)
    model = spec.build(settings)
    batch = spec.make_batch(settings, torch.float32)
    counter = FlopCounterMode(display=False)
    with counter:
        model(**batch)
    counts = counter.get_flop_counts()
    blocks = [name for name in counts if name.rsplit(".", 2)[-2:-1] == ["h"]]
    assert blocks, list(counts)
    return sum(sum(counts[name].values()) for name in blocks)


def test_compare_rows_match_estimates_and_recompute_is_the_blocks_forward():
    result = compare("tiny-gpt2", batch_size=4, gpus=2, **BASE)
    rows = {row.name: row for row in result.rows}
    assert {"as given", "AMP bf16", "pure bf16", "grad accumulation ×2", "grad accumulation ×4", "Adafactor",
            "8-bit Adam", "checkpoint all blocks"} <= set(rows)  # fmt: skip
    for row in result.rows:
        s = row.estimate.settings
        assert row.effective_batch_size == s.batch_size * s.grad_accum * 2 == 8
        # one trace a row, at its batch size: a row shows no per-sample slope, which an estimate traces a second
        # batch size for
        assert row.estimate.traces == 1 and row.estimate.per_sample_activation_bytes is None
    for name in ("as given", "grad accumulation ×4", "pure bf16"):
        settings = rows[name].estimate.settings.to_dict()
        assert rows[name].estimate.peak_bytes == estimate("tiny-gpt2", **settings).peak_bytes
    assert rows["grad accumulation ×4"].estimate.settings.batch_size == 1
    assert rows["checkpoint all blocks"].recompute_flops == _block_forward_flops(4)
    assert rows["checkpoint all blocks"].estimate.peak_bytes < rows["as given"].estimate.peak_bytes
    from rich.console import Console

    from memplan.render.explore import render_compare

    console = Console(record=True, width=200)
    render_compare(result, console)
    assert console.export_text().splitlines()[0].endswith(", rows on 2 data-parallel GPUs")  # its table multiplies by 2


def test_cli_sweep_and_compare(tmp_path):
    plot = tmp_path / "sweep.png"
    args = ["tiny-gpt2", "--seq-len", "32", "--device", "cpu"]
    swept = CliRunner().invoke(main, ["sweep", *args, "--batch-sizes", "1,2", "--plot", str(plot), "--json"])
    assert swept.exit_code == 0, swept.output
    assert [p["batch_size"] for p in json.loads(swept.stdout)["series"][0]["points"]] == [1, 2]
    assert plot.read_bytes()[:4] == b"\x89PNG"
    refused = CliRunner().invoke(main, ["sweep", *args, "-b", "4"])
    assert refused.exit_code == 2 and "--batch-sizes" in refused.output
    bad = CliRunner().invoke(main, ["sweep", *args, "--precisions", "fp8"])
    assert bad.exit_code == 2 and "--precisions takes a comma-separated list" in bad.output
    table = CliRunner().invoke(main, ["compare", *args, "-b", "2"])
    assert table.exit_code == 0, table.output
    assert "grad accumulation ×2" in table.output and "2×1 = 2" in table.output


@pytest.mark.parametrize("gpus", [0, -1])
def test_compare_refuses_no_gpus(gpus):
    result = CliRunner().invoke(main, ["compare", "tiny-gpt2", "--gpus", str(gpus)])
    assert result.exit_code == 2 and "--gpus must be a positive integer" in result.output


def test_compare_from_checkpoint_all_without_blocks_keeps_the_given_row():
    result = compare("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs", checkpoint="all", device="cpu")
    assert result.rows[0].name == "as given" and not result.rows[0].estimate.checkpointed_blocks


def test_over_budget_is_said_in_text_and_the_sweep_header_names_no_single_precision():
    """Piped output has no colour: an over-budget cell carries ✗; fitting cells do not."""
    args = ["tiny-gpt2", "--seq-len", "32", "--device", "cpu", "--budget", "60MiB"]
    swept = CliRunner().invoke(main, ["sweep", *args, "--batch-sizes", "1,256", "--precisions", "fp32,amp-bf16"])
    assert swept.exit_code == 0, swept.output
    header = swept.stdout.splitlines()[0]  # stdout: progress lines go to stderr when tracing is slow
    assert "fp32" not in header and "amp-bf16" not in header  # the columns name them
    rows = {line.split("│")[1].strip(): line for line in swept.stdout.splitlines() if line.count("│") >= 3}
    assert "✗" not in rows["1"] and rows["256"].count("✗") == 2
    compared = CliRunner().invoke(main, ["compare", *args, "-b", "256"])
    assert compared.exit_code == 0, compared.output
    as_given = next(line for line in compared.stdout.splitlines() if "as given" in line)
    accumulated = next(line for line in compared.stdout.splitlines() if "grad accumulation ×4" in line)
    assert "✗" in as_given and "✗" not in accumulated


def _interrupt_at(marker: str):
    """A progress callback that raises KeyboardInterrupt, as Ctrl-C does, once `marker` is reported."""

    def progress(message: str) -> None:
        if marker in message:
            raise KeyboardInterrupt

    return progress


def test_ctrl_c_in_a_sweep_or_compare_keeps_what_finished(tiny_model_dirs):
    from memplan.explore.compare import run_compare
    from memplan.explore.sweep import run_sweep

    spec = resolve_model(tiny_model_dirs["gpt2"])
    settings = TrainingSettings(seq_len=32, device="cpu")
    swept = run_sweep(
        spec, settings, batch_sizes=(1, 2), precisions=("fp32", "amp-bf16"), progress=_interrupt_at("[2/2]")
    )
    assert swept.interrupted and [s.precision for s in swept.series] == ["fp32"]
    assert [p.batch_size for p in swept.series[0].points] == [1, 2]
    assert swept.to_dict()["interrupted"] is True
    compared = run_compare(spec, settings.replace(batch_size=2), progress=_interrupt_at("[3/"))
    assert compared.interrupted and [row.name for row in compared.rows] == ["as given", "AMP bf16"]
    with pytest.raises(KeyboardInterrupt):  # nothing finished: nothing to show
        run_sweep(spec, settings, batch_sizes=(1,), progress=_interrupt_at("[1/1]"))


def test_ctrl_c_in_the_cli_sweep_shows_the_finished_table_and_exits_130(tiny_model_dirs, monkeypatch, tmp_path):
    import memplan.cli.running
    import memplan.render.plot

    monkeypatch.setattr(memplan.cli.running, "_progress", lambda as_json: _interrupt_at("[2/2]"))
    plotted = {}
    monkeypatch.setattr(memplan.render.plot, "plot_sweep", lambda series, path, **drawn: plotted.update(drawn))
    args = [tiny_model_dirs["gpt2"], "--seq-len", "32", "--device", "cpu", "--batch-sizes", "1,2"]
    plot = ["--plot", str(tmp_path / "sweep.png")]
    result = CliRunner().invoke(main, ["sweep", *args, "--precisions", "fp32,amp-bf16", *plot])
    assert result.exit_code == 130, result.output
    assert "fp32" in result.output and "amp-bf16" not in result.output.split("predicted peak")[1]
    assert result.output.strip().endswith("memplan: interrupted; shown: what finished before it")
    # the plot of what finished says so: it had looked like a sweep of one precision (CLI bug hunt, M8)
    assert plotted["title"].endswith("(interrupted: the settings that finished before Ctrl-C)")


def test_which_gpu_fits_each_cards_usable_memory_and_names_the_cheapest_listed_card_that_fits():
    """tiny-gpt2 at batch 6,000 completes in about 15.7 GiB: more than a T4's 14.5 GiB usable (15,360 MiB
    less the 767 MiB context), less than an L4's or an H200's. The T4 is cheaper but does not fit; the
    H200 has no listed price; so the L4 is the cheapest that fits (prices: memplan.prices' table)."""
    from memplan.api import which_gpu
    from memplan.gpus import CONTEXT_BYTES, GPUS

    result = which_gpu("tiny-gpt2", "t4, L4,h200", batch_size=6000, seq_len=128)
    assert [option.gpu for option in result.options] == ["T4", "L4", "H200"]
    for option in result.options:
        e = option.estimate
        assert e.settings.gpu == option.gpu
        assert e.budget_bytes == GPUS[option.gpu].total_bytes - CONTEXT_BYTES
        assert e.fits == (e.smallest_device_bytes <= e.budget_bytes)
    assert [option.estimate.fits for option in result.options] == [False, True, True]
    assert [option.price.usd_per_hour if option.price else None for option in result.options] == [0.5904, 0.7992, None]
    assert result.cheapest is result.options[1]
    alone = estimate("tiny-gpt2", batch_size=6000, seq_len=128, gpu="T4")
    t4 = result.options[0].estimate
    assert (t4.peak_bytes, t4.smallest_device_bytes, t4.max_batch_size) == (
        alone.peak_bytes,
        alone.smallest_device_bytes,
        alone.max_batch_size,
    )
    data = result.to_dict()
    assert (data["fitting"], data["cheapest"]) == (["L4", "H200"], "L4")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--gpu", "T4,L4", "--budget", "1GiB"], "--budget with several --gpu cards"),
        (["--gpu", "T4,L4", "--maximize", "seq-len"], "--maximize with several --gpu cards"),
        (["--gpu", "T4,t4"], "T4 is named more than once"),
        (["--gpu", "T4,X9"], "unknown GPU 'X9'"),
        (["--gpu", "T4,L4", "--device", "cpu"], "choosing a GPU needs the cuda target"),
    ],
)
def test_estimate_with_several_cards_refuses_what_needs_one(arguments, message):
    outcome = CliRunner().invoke(main, ["estimate", "tiny-gpt2", "--seq-len", "32", *arguments])
    assert outcome.exit_code == 2, outcome.output
    assert message in outcome.output and "Traceback" not in outcome.output


def test_compare_on_lora_offers_qlora_and_skips_it_where_it_cannot_apply(monkeypatch):
    from memplan.explore import compare as compare_module
    from memplan.explore.compare import techniques
    from memplan.settings import TrainingSettings

    def offered(**settings: object) -> list[dict]:
        listed = techniques(TrainingSettings(batch_size=2, device="cpu", **settings))
        return [technique.changes for technique in listed if technique.name == "QLoRA (NF4 base)"]

    assert offered(lora_rank=4) == [{"quantize": "nf4"}]
    assert offered(lora_rank=4, quantize="nf4") == [] and offered() == []
    # Only the given row and the QLoRA one, on a model of the user's own: QLoRA cannot apply there.
    monkeypatch.setattr(
        compare_module,
        "techniques",
        lambda base: [t for t in techniques(base) if not t.changes or "quantize" in t.changes],
    )
    own = compare(
        "tests.zoo_models:linear_stack",
        inputs="tests.zoo_models:features_inputs",
        loss="tests.zoo_models:mean_square_loss",
        batch_size=2,
        device="cpu",
        lora_rank=4,
        lora_targets="out",
    )
    assert "QLoRA (NF4 base)" not in {row.name for row in own.rows}
    assert any(
        reason.startswith("QLoRA (NF4 base): --quantize quantizes a transformers model") for reason in own.skipped
    )


def test_every_checkpointed_series_is_labelled_with_its_mode():
    """A selective series was labelled as the unchecked one ("fp32" twice)."""
    from memplan.explore.sweep import series_label

    labels = [series_label("fp32", mode) for mode in ("none", "all", "selective")]
    assert labels == ["fp32", "fp32, checkpoint all", "fp32, checkpoint selective"]


def test_a_precision_named_twice_is_one_line():
    import pytest

    from memplan.errors import SettingsError

    with pytest.raises(SettingsError, match="precisions names fp32 more than once"):
        sweep("tiny-gpt2", batch_sizes=(1,), precisions=("fp32", "fp32"), **BASE)


def test_which_gpu_on_a_data_parallel_rank_says_nccl_s_buffers_are_left_out_of_usable_too():
    """Its footnote said "the card's memory less the CUDA context" where the budget leaves NCCL's buffers out too."""
    import io

    from rich.console import Console

    from memplan.api import which_gpu
    from memplan.gpus import CONTEXT_BYTES, GPUS
    from memplan.render.explore import render_gpu_choice

    result = which_gpu("tiny-gpt2", "T4,L4", batch_size=2, seq_len=16, parallel="ddp", world_size=2)
    for option in result.options:
        e = option.estimate
        usable = GPUS[option.gpu].total_bytes - CONTEXT_BYTES - e.communicator_bytes
        assert e.communicator_bytes and e.budget_bytes == usable
    console = Console(width=120, file=io.StringIO(), highlight=False)
    render_gpu_choice(result, console)
    assert "less the CUDA context and NCCL's buffers" in " ".join(console.file.getvalue().split())


def test_compare_s_figures_are_whole_in_a_120_column_pipe():
    """Piped, the table is 120 columns wide; the technique names on one line left the figures "optimi…" and
    "+30897…%". Every row's figures must be there whole."""
    import dataclasses
    import io

    from rich.console import Console

    from memplan.explore.compare import CompareResult, CompareRow, techniques
    from memplan.render.explore import render_compare
    from memplan.sizes import format_bytes

    # A DDP rank's rows, as compare names them, each with one estimate's figures scaled (the renderer is what is
    # tested: one trace instead of a dozen); the DeepSpeed rows' peaks were 339 times the given one's.
    given = estimate("tests.ddp_models:stack", inputs="tests.ddp_models:rows", loss="tests.ddp_models:mean_square",
                     batch_size=8, device="cpu", parallel="ddp", world_size=2)  # fmt: skip
    rows = [CompareRow("as given", "", given, 16, None)]
    for scale, technique in enumerate(techniques(given.settings), start=2):
        scaled = dataclasses.replace(
            given, peak_bytes=given.peak_bytes * (339 if "DeepSpeed" in technique.name else scale)
        )
        rows.append(CompareRow(technique.name, technique.cost, scaled, 16, None))
    result = CompareResult("stack", given.settings, 1, None, tuple(rows), (), 1.0)
    assert any(len(row.name) > 36 for row in result.rows)  # names that wrap
    console = Console(width=120, file=io.StringIO(), highlight=False)
    render_compare(result, console)
    shown = console.file.getvalue()
    assert max(len(line) for line in shown.splitlines()) <= 120
    cells = {cell.strip() for line in shown.splitlines() for cell in line.split("│")}
    reference = result.rows[0].estimate.peak_bytes
    for row in result.rows:
        e = row.estimate
        assert {format_bytes(e.breakdown.optimizer_state), format_bytes(e.breakdown.activations)} <= cells, row.name
        if row is not result.rows[0]:
            assert f"{(e.peak_bytes - reference) / reference:+.1%}" in cells, row.name


def test_a_sweep_plot_s_title_names_the_precision_only_where_one_is_swept(monkeypatch, tmp_path):
    """Over fp32 and amp-bf16 its title said "fp32", where the table's heading names none."""
    import memplan.render.plot as plot_module

    titles: list[str] = []
    monkeypatch.setattr(plot_module, "plot_sweep", lambda *args, title, **kwargs: titles.append(title))
    args = ["sweep", "tiny-gpt2", "--seq-len", "16", "--batch-sizes", "1,2", "--device", "cpu", "-q"]
    for precisions in ("fp32,amp-bf16", "amp-bf16"):
        done = CliRunner().invoke(main, [*args, "--precisions", precisions, "--plot", str(tmp_path / "sweep.png")])
        assert done.exit_code == 0, done.output
    assert "fp32" not in titles[0] and "amp-bf16" not in titles[0]
    assert "amp-bf16" in titles[1]
