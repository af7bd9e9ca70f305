"""Each convolution call's cuDNN workspace: memplan's band top beside what a GPU run requested.

    python benchmarks/conv_workspaces.py docs/validation/h100/traces-main.tar.gz CONFIG_ID [...] \
        [--gpu H100-80GB] [--json OUT]

The measured side has no labels: an allocator trace is sizes in order. This script lines the
run's request sizes up with memplan's predicted requests for the same configuration
(difflib.SequenceMatcher over the sizes), and reports, for every stretch that differs, the
convolution call(s) memplan predicted there (direction, input and weight shapes, stride,
padding, dtype) and the sizes the run requested instead. Where the rest of the step matches
request for request (as in ResNet's forward), the unmatched measured requests next to a
convolution are its workspaces; elsewhere the pairing is a guess, and the output says which
stretches were replaced, deleted or inserted so a reader can judge. Evidence for modelling
cuDNN's choice; not a test.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2**20


def conv_rows(archive: Path, config_id: str, gpu: str) -> list[dict]:
    import torch
    from trace_diff import measured_events, predicted

    import memplan.estimator.transients as transients_module

    described: list[tuple] = []
    original = transients_module._conv_workspace

    def describing(node, args, settings):  # type: ignore[no-untyped-def]
        requests = original(node, args, settings)
        if node.target == torch.ops.aten.convolution.default:
            x, weight, stride, padding = args[0], args[1], args[3], args[4]
            call = ("forward", tuple(x.shape), tuple(weight.shape), tuple(stride), tuple(padding), str(x.dtype))
        else:
            x, weight, stride, padding = args[1], args[2], args[4], args[5]
            call = ("backward", tuple(x.shape), tuple(weight.shape), tuple(stride), tuple(padding), str(x.dtype))
        described.append(call)
        return tuple(request._replace(name=f"{request.name}|{len(described) - 1}") for request in requests)

    transients_module._conv_workspace = describing
    try:
        real = measured_events(archive, config_id)
        _, _, result = predicted(config_id, gpu)
    finally:
        transients_module._conv_workspace = original
    timeline = result.timeline
    ours = sorted(
        (a for a in timeline.allocations if not a.persists(timeline.node_count) and a.size_bytes),
        key=lambda a: a.allocated_at,
    )
    theirs = [size for action, _, size, _ in real["events"] if action == "alloc"]
    matcher = difflib.SequenceMatcher(a=[a.requested_bytes or a.size_bytes for a in ours], b=theirs, autojunk=False)
    rows = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        workspaces = [a for a in ours[i1:i2] if "|" in a.op]
        rows.append(
            {
                "stretch": tag,
                "calls": [described[int(a.op.rsplit("|", 1)[1])] for a in workspaces],
                "predicted_workspace_bytes": [a.requested_bytes or a.size_bytes for a in workspaces],
                "other_predicted": [(a.op, a.requested_bytes or a.size_bytes) for a in ours[i1:i2] if "|" not in a.op],
                "measured_bytes": theirs[j1:j2],
            }
        )
    return rows


def summary(rows: list[dict]) -> dict[str, int]:
    """Counts per (direction, kernel, outcome): a lone predicted workspace against a lone measured
    request ("under 1 MiB", "the top" within 0.01 MiB, "above the top", "below the top"), and
    predicted workspaces the run did not request at all ("none")."""
    counts: collections.Counter[str] = collections.Counter()
    for row in rows:
        for call in row["calls"] if row["stretch"] == "delete" else ():
            counts[f"{call[0]} {'1x1' if call[2][2] == 1 else 'kxk'} none"] += 1
        lone = len(row["calls"]) == 1 and len(row["measured_bytes"]) == 1 and not row["other_predicted"]
        if row["stretch"] != "replace" or not lone:
            continue
        call, predicted, measured = row["calls"][0], row["predicted_workspace_bytes"][0], row["measured_bytes"][0]
        if measured < MiB:
            outcome = "under 1 MiB"
        elif abs(measured - predicted) < 0.01 * MiB:
            outcome = "the top"
        else:
            outcome = "above the top" if measured > predicted else "below the top"
        counts[f"{call[0]} {'1x1' if call[2][2] == 1 else 'kxk'} {outcome}"] += 1
    return dict(sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archive", type=Path)
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--gpu", default="H100-80GB")
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args()
    everything = {}
    for config_id in arguments.configs:
        rows = conv_rows(arguments.archive, config_id, arguments.gpu)
        everything[config_id] = rows
        print(f"# {config_id}")
        for row in rows:
            call = row["calls"][0] if row["calls"] else "-"
            predicted = [round(n / MiB, 3) for n in row["predicted_workspace_bytes"]]
            measured = [round(n / MiB, 4) for n in row["measured_bytes"]]
            print(f"{row['stretch']:8s} {call} predicted {predicted} MiB, measured {measured} MiB")
        print(f"summary: {summary(rows)}")
    if arguments.json:
        arguments.json.write_text(json.dumps(everything, indent=1) + "\n")


if __name__ == "__main__":
    main()
