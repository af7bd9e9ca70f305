"""PNG pictures with matplotlib (Agg, no display): the iteration's memory over time, and sweeps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from memplan.errors import OutputError
from memplan.estimator.timeline import BREAKDOWN_KEYS, MemoryTimeline
from memplan.outputs import write_atomically
from memplan.sizes import format_bytes

# The plot draws at most this many points per category; each bin keeps the node where the total is
# highest, so the peak survives the thinning.
MAX_PLOT_POINTS = 4000
CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (saved for backward)",
    "temporaries": "temporaries",
    "inputs": "inputs",
    "workspaces": "cuBLAS / cuDNN workspaces",
    "communication": "communication buffers (DDP buckets, FSDP2 collectives)",
    "unsharded_parameters": "unsharded parameters (FSDP2, ZeRO-3)",
}
CATEGORY_COLOURS = {  # matplotlib's tab10, one colour per category
    "parameters": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer_state": "#2ca02c",
    "activations": "#d62728",
    "temporaries": "#9467bd",
    "inputs": "#8c564b",
    "workspaces": "#7f7f7f",
    "communication": "#bcbd22",
    "unsharded_parameters": "#17becf",
}


def _unit(max_bytes: float) -> tuple[str, int]:
    return ("GiB", 1 << 30) if max_bytes >= 1 << 30 else ("MiB", 1 << 20)


def _thinned_nodes(totals: Sequence[int]) -> list[int]:
    count = len(totals)
    if count <= MAX_PLOT_POINTS:
        return list(range(count))
    bins = [(count * i // MAX_PLOT_POINTS, count * (i + 1) // MAX_PLOT_POINTS) for i in range(MAX_PLOT_POINTS)]
    return [max(range(start, stop), key=totals.__getitem__) for start, stop in bins if stop > start]


def _figure():  # noqa: ANN202 - matplotlib's types
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_plot_path(path: str | Path) -> None:
    """Refuse a file type matplotlib would not write (before the work, not after it)."""
    if Path(path).suffix.lower() not in PLOT_SUFFIXES:
        raise OutputError(f"--plot {path}: name a {', '.join(PLOT_SUFFIXES)} file, e.g. memory.png")


def _save(figure: object, path: str | Path) -> None:
    check_plot_path(path)
    suffix = Path(path).suffix.lower().lstrip(".")
    try:
        write_atomically(path, lambda file: figure.savefig(file, dpi=120, format=suffix), "plot")  # type: ignore[attr-defined]
    except ValueError as error:
        raise OutputError(f"cannot write the plot to {path}: {error}") from error


def plot_timeline(
    timeline: MemoryTimeline,
    path: str | Path,
    *,
    title: str,
    budget_bytes: int | None = None,
    reserved_peak_bytes: int | None = None,
) -> None:
    """A stacked area of each category's live bytes across the iteration, phases marked, peak annotated.

    On cuda the reserved peak is drawn as a line too: what the caching allocator holds when memory is
    plentiful (a budget holds the least memory the step completes in, between the two).
    """
    plt = _figure()
    per_category = timeline.category_bytes()
    totals = [sum(values) for values in zip(*per_category.values(), strict=True)]
    peak_node = max(range(len(totals)), key=totals.__getitem__)
    nodes = _thinned_nodes(totals)
    top = max(totals[peak_node], budget_bytes or 0, reserved_peak_bytes or 0)
    unit, scale = _unit(top)
    figure, axes = plt.subplots(figsize=(12, 5.5))
    shown = [key for key in BREAKDOWN_KEYS if any(per_category[key])]
    axes.stackplot(
        nodes,
        [[per_category[key][node] / scale for node in nodes] for key in shown],
        labels=[CATEGORY_LABELS[key] for key in shown],
        colors=[CATEGORY_COLOURS[key] for key in shown],
        step="post",
        linewidth=0,
    )
    # The total as a line on top: a spike one op wide is narrower than a pixel of the stacked areas,
    # but a line is drawn at least a pixel wide, and the marker sits on the peak itself.
    axes.plot(nodes, [totals[node] / scale for node in nodes], drawstyle="steps-post", color="black", linewidth=0.6)
    axes.plot([peak_node], [totals[peak_node] / scale], marker="v", color="black", markersize=6, zorder=5)
    for phase, start in timeline.phase_starts().items():
        axes.axvline(start, color="black", linewidth=0.8, linestyle=":", zorder=0)
        axes.text(start, top / scale * 1.07, f" {phase}", va="top", ha="left", fontsize=9)
    peak = totals[peak_node]
    axes.annotate(
        f"peak {format_bytes(peak)}",
        xy=(peak_node, peak / scale),
        xytext=(0.5, 0.97),
        textcoords="axes fraction",
        ha="center",
        arrowprops={"arrowstyle": "->", "color": "black"},
    )
    if budget_bytes is not None:
        axes.axhline(budget_bytes / scale, color="red", linestyle="--", linewidth=1.2)
        axes.text(0, budget_bytes / scale, f" budget {format_bytes(budget_bytes)}", color="red", va="bottom")
    if reserved_peak_bytes is not None:
        axes.axhline(reserved_peak_bytes / scale, color="black", linestyle=":", linewidth=1.0)
        axes.text(
            timeline.node_count,
            reserved_peak_bytes / scale,
            f"reserved peak {format_bytes(reserved_peak_bytes)} ",
            ha="right",
            va="bottom",
            fontsize=9,
        )
    axes.set_xlim(0, timeline.node_count)
    axes.set_ylim(0, top / scale * 1.1)
    axes.set_xlabel("graph node of the traced iteration (forward, backward, optimizer step)")
    axes.set_ylabel(f"allocated memory ({unit})")
    axes.set_title(title, fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)


def plot_sweep(
    series: dict[str, list[tuple[int, int]]],
    path: str | Path,
    *,
    title: str,
    budget_bytes: int | None = None,
    max_batch_sizes: dict[str, int | None] | None = None,
    measure: str = "predicted peak",
) -> None:
    """Peak bytes against batch size, one line per setting, with the budget and each largest fitting batch."""
    plt = _figure()
    top = max([peak for points in series.values() for _, peak in points] + [budget_bytes or 0])
    unit, scale = _unit(top)
    figure, axes = plt.subplots(figsize=(11, 5.5))
    for label, points in series.items():
        line = axes.plot([batch for batch, _ in points], [peak / scale for _, peak in points], marker="o", label=label)[
            0
        ]
        largest = (max_batch_sizes or {}).get(label)
        if largest:
            axes.axvline(largest, color=line.get_color(), linestyle=":", linewidth=1)
    if budget_bytes is not None:
        axes.axhline(budget_bytes / scale, color="red", linestyle="--", linewidth=1.2)
        axes.text(
            0.01,
            budget_bytes / scale,
            f" budget {format_bytes(budget_bytes)}",
            color="red",
            va="bottom",
            transform=axes.get_yaxis_transform(),
        )
    axes.set_xscale("log", base=2)
    batch_sizes = sorted({batch for points in series.values() for batch, _ in points})
    axes.set_xticks(batch_sizes, [str(batch) for batch in batch_sizes])
    axes.minorticks_off()
    axes.set_xlabel("micro-batch size (dotted: largest that fits)")
    axes.set_ylabel(f"{measure} ({unit})")
    axes.set_ylim(0, top / scale * 1.1)
    axes.set_title(title, fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)
