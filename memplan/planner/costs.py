"""What checkpointing each candidate would free and cost, read off one trace without checkpointing.

Candidates form a chain in forward order (blocks of `nn.ModuleList`s). Block j's forward ends at
node `forward_end[j]`; its backward starts at `backward_start[j]`, the first node that frees one
of its saved tensors. At node i the *level* is how many blocks have finished their forward but
not begun their backward; in a chain these intervals nest, so level k means blocks 0..k-1 hold
their saved tensors. Level k covers block k's forward and block k's backward (plus the head at
level n). Checkpointing a segment a..b removes `freed_bytes(a, b)` — the storages born in it,
saved for the backward, and read by no forward op after it (storage-exact, from the trace's
liveness) — from every level above b, and from levels inside the segment's forward as it goes;
its backward first recomputes the segment's forward on top of what is live then — up to torch's early
stop (`_early_stops`): what it recomputes, and how far that raises live bytes, stop at the pack of the
segment's last saved tensor.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from memplan.errors import SettingsError
from memplan.estimator.flops import node_flops
from memplan.estimator.liveness import Liveness
from memplan.estimator.rng_snapshots import checkpoint_state_bytes
from memplan.estimator.simulate import Simulation
from memplan.estimator.traced_step import TracedStep


@dataclass(frozen=True)
class ChainCosts:
    names: tuple[str, ...]  # candidates in forward order
    forward_flops: tuple[int, ...]  # per candidate: what recomputing it costs
    chainable: tuple[bool, ...]  # candidate j and j+1 may share one checkpoint (consecutive siblings)
    forward_level_peak: tuple[int, ...]  # per level 0..n: highest live bytes at forward nodes
    backward_level_peak: tuple[int, ...]  # per level 0..n: highest live bytes at backward/optimizer nodes
    backward_start_bytes: tuple[int, ...]  # per candidate: live bytes where its backward starts
    freed: tuple[tuple[int, ...], ...]  # freed[a][b - a]: bytes a checkpoint over a..b frees
    forward_growth: tuple[tuple[int, ...], ...]  # growth[a][b - a]: how far live bytes rise in a..b's forward
    step_flops: int  # the whole traced step without checkpointing
    # recomputed[a][b - a]: FLOPs a checkpoint over a..b recomputes, which stops early (see _early_stops);
    # growth_recomputed[a][b - a]: how far live bytes rise in that recomputation. Empty where the trace
    # recorded no saved tensors (a --step of the user's own): then every block's whole forward.
    recomputed: tuple[tuple[int, ...], ...] = ()
    growth_recomputed: tuple[tuple[int, ...], ...] = ()
    # per candidate: live bytes just before the first backward op that reads one of its saved tensors, where
    # a checkpoint ending with it recomputes (empty: backward_start_bytes, which also holds that op's outputs)
    recompute_start_bytes: tuple[int, ...] = ()
    # What each checkpoint holds besides its saved tensors from its forward's start until its backward ends, and
    # takes once more while it recomputes: on the cpu target, torch.utils.checkpoint's copy of the CPU generator's
    # state (preserve_rng_state, torch's default) and torch.random.fork_rng's (memplan.estimator.rng_snapshots);
    # 0 on cuda, where that copy is host memory.
    checkpoint_state_bytes: int = 0

    def __len__(self) -> int:
        return len(self.names)

    def freed_bytes(self, first: int, last: int) -> int:
        """What a closed checkpoint over first..last takes off every later level: its saved tensors, less the
        state it holds."""
        return self.freed[first][last - first] - self.checkpoint_state_bytes

    def growth_bytes(self, first: int, last: int) -> int:
        """How far live bytes rise while a checkpoint over first..last recomputes (its forward, to the early stop;
        fork_rng's copy of the state with it)."""
        table = self.growth_recomputed or self.forward_growth
        return table[first][last - first] + self.checkpoint_state_bytes

    def recompute_base_bytes(self, last: int) -> int:
        """Live bytes, without checkpointing, where a checkpoint ending with candidate `last` would recompute."""
        return (self.recompute_start_bytes or self.backward_start_bytes)[last]

    def can_join(self, first: int, last: int) -> bool:
        return all(self.chainable[first:last])

    def segment_flops(self, first: int, last: int) -> int:
        """What one checkpoint over first..last recomputes."""
        if self.recomputed:
            return self.recomputed[first][last - first]
        return sum(self.forward_flops[first : last + 1])

    def recompute_flops(self, segments: list[tuple[int, int]]) -> int:
        return sum(self.segment_flops(a, b) for a, b in segments)


def _in_module(module: str | None, name: str) -> bool:
    return module is not None and (module == name or module.startswith(name + "."))


def _consecutive_siblings(first: str, second: str) -> bool:
    parent_a, _, index_a = first.rpartition(".")
    parent_b, _, index_b = second.rpartition(".")
    return parent_a == parent_b and index_a.isdigit() and index_b.isdigit() and int(index_b) == int(index_a) + 1


def _nothing_between(nodes: list, end: int, start: int) -> bool:
    """Whether the parent computes nothing between one block's last forward op and the next one's
    first: only then does the next block take the previous one's output as it is, which a segment
    checkpoint over both needs (memplan.estimator.checkpointing). Picking an item of a block's
    returned tuple is no computation."""
    return all(
        nodes[index].op != "call_function" or nodes[index].target is operator.getitem for index in range(end + 1, start)
    )


def select_candidates(
    module_names: list[str], blocks: list[str], pattern: str | None, containers: frozenset[str] = frozenset()
) -> list[str]:
    """The default candidates are the repeated blocks; a regex picks the outermost matching modules that are
    called. `containers` are modules nobody calls (an nn.ModuleList: its parent calls its blocks): a checkpoint
    on one would checkpoint nothing, so the match goes on to what is inside."""
    if pattern is None:
        return blocks
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise SettingsError(f"--candidates '{pattern}' is not a valid regular expression: {error}") from None
    chosen: list[str] = []
    uncalled: list[str] = []
    for name in module_names:
        if not name or not regex.fullmatch(name) or any(name.startswith(outer + ".") for outer in chosen):
            continue
        (uncalled if name in containers else chosen).append(name)
    if not chosen and uncalled:
        raise SettingsError(
            f"--candidates '{pattern}' matches only {uncalled[0]!r}, a container of blocks that is never called "
            f"itself (a ModuleList): match its blocks, e.g. '{re.escape(uncalled[0])}\\.\\d+'"
        )
    if not chosen:
        raise SettingsError(f"--candidates '{pattern}' matches no module; module names look like {blocks[:2]}")
    return chosen


def chain_costs(traced: TracedStep, lifetimes: Liveness, simulation: Simulation, names: list[str]) -> ChainCosts:
    """Costs of checkpointing `names` (candidate modules), from a trace of the step without checkpointing."""
    nodes, modules = lifetimes.nodes, traced.node_modules
    forward_end = traced.forward_end
    spans: dict[str, tuple[int, int]] = {}
    for name in names:
        indices = [i for i in range(forward_end) if _in_module(modules[i], name)]
        if indices:
            spans[name] = (indices[0], indices[-1])
    order = sorted(spans, key=lambda name: spans[name][0])
    if not order:
        raise SettingsError("none of the checkpoint candidates runs any op in the forward pass")
    count = len(order)
    starts = [spans[name][0] for name in order]
    ends = [spans[name][1] for name in order]
    timeline = simulation.timeline_bytes

    def block_at(index: int) -> int | None:
        for j in range(count):
            if starts[j] <= index <= ends[j]:
                return j
        return None

    # Last forward reader of every storage, to tell internal tensors from a block's output.
    last_forward_read: dict[object, int] = {}
    index_of = {node: i for i, node in enumerate(nodes)}
    for i in range(forward_end):
        for source in nodes[i].all_input_nodes:
            for key, _ in lifetimes.storages[index_of[source]]:
                last_forward_read[key] = i
    # contributions[x][y]: bytes born in block x, saved for the backward, last read in forward by block y.
    contributions = [[0] * count for _ in range(count)]
    backward_start = [len(nodes)] * count
    # First backward op reading each storage: a checkpoint recomputes when its backward first unpacks.
    first_backward_read: dict[object, int] = {}
    for i in range(forward_end, len(nodes)):
        for source in nodes[i].all_input_nodes:
            for key, _ in lifetimes.storages[index_of[source]]:
                first_backward_read.setdefault(key, i)
    recompute_at = [len(nodes)] * count
    for key, born in lifetimes.born.items():
        if lifetimes.last_use[key] < forward_end or lifetimes.last_use[key] >= len(nodes):
            continue  # not saved for the backward, or live to the end (outputs, state)
        born_block = block_at(born)
        if born_block is None:
            continue
        read = last_forward_read.get(key, born)
        read_block = next((j for j in range(born_block, count) if read <= ends[j]), None)
        if read_block is None:
            continue  # read by the head after the last candidate: never freed by checkpointing
        contributions[born_block][read_block] += lifetimes.size[key]
        if read_block == born_block:
            backward_start[born_block] = min(backward_start[born_block], lifetimes.last_use[key])
            recompute_at[born_block] = min(recompute_at[born_block], first_backward_read.get(key, len(nodes)))
    for j in range(count - 2, -1, -1):  # blocks with nothing saved start their backward with their successor
        if backward_start[j] == len(nodes):
            backward_start[j] = backward_start[j + 1]

    born_at = [0] * len(nodes)
    for key, index in lifetimes.born.items():
        if 0 <= index < len(nodes):
            born_at[index] += lifetimes.size[key]

    def bytes_before(at: int) -> int:
        """Live bytes just before node `at` runs: neither its outputs (born there) nor what only the node before it
        held."""
        before = timeline[at] - born_at[at]
        return min(before, timeline[at - 1]) if at > 0 else before

    recompute_start = []
    for j in range(count):
        at = min(recompute_at[j], backward_start[j])
        if at >= len(timeline):
            at = backward_start[j]
        recompute_start.append(bytes_before(min(at, len(timeline) - 1)))
    freed = [[0] * (count - a) for a in range(count)]
    for a in range(count - 1, -1, -1):
        row_total = 0
        for b in range(a, count):
            row_total += contributions[a][b]
            freed[a][b - a] = row_total + (freed[a + 1][b - a - 1] if b > a else 0)
    block_high = [max(timeline[starts[j] : ends[j] + 1]) for j in range(count)]
    growth = []
    for a in range(count):
        base = timeline[starts[a] - 1] if starts[a] > 0 else 0
        row, highest = [], 0
        for b in range(a, count):
            highest = max(highest, block_high[b])
            row.append(max(0, highest - base))
        growth.append(tuple(row))

    forward_peak = [0] * (count + 1)
    backward_peak = [0] * (count + 1)
    for i, live in enumerate(timeline):
        level = sum(1 for j in range(count) if ends[j] < i < backward_start[j])
        if i < forward_end:
            forward_peak[level] = max(forward_peak[level], live)
        else:
            backward_peak[level] = max(backward_peak[level], live)
    flops = [sum(node_flops(nodes[i]) for i in range(starts[j], ends[j] + 1)) for j in range(count)]
    entry_bytes = [bytes_before(start) for start in starts]  # live bytes just before each block's first op
    recomputed, growth_recomputed = _early_stops(traced, nodes, order, starts, ends, timeline, entry_bytes)
    return ChainCosts(
        names=tuple(order),
        forward_flops=tuple(flops),
        chainable=tuple(
            _consecutive_siblings(order[j], order[j + 1]) and _nothing_between(nodes, ends[j], starts[j + 1])
            for j in range(count - 1)
        ),
        forward_level_peak=tuple(forward_peak),
        backward_level_peak=tuple(backward_peak),
        backward_start_bytes=tuple(timeline[min(b, len(timeline) - 1)] for b in backward_start),
        freed=tuple(tuple(row) for row in freed),
        forward_growth=tuple(growth),
        step_flops=sum(node_flops(node) for node in nodes),
        recomputed=recomputed,
        growth_recomputed=growth_recomputed,
        recompute_start_bytes=tuple(recompute_start),
        checkpoint_state_bytes=checkpoint_state_bytes(traced.settings.device),
    )


def _early_stops(
    traced: TracedStep,
    nodes: list,
    order: list[str],
    starts: list[int],
    ends: list[int],
    timeline: list[int],
    entry_bytes: list[int],
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """What a checkpoint over a..b recomputes, and how far live bytes rise meanwhile.

    A non-reentrant checkpoint (torch.utils.checkpoint, use_reentrant=False, which memplan traces and
    apply_plan uses) counts the tensors its forward saved; its recomputation's pack hook
    (`_recomputation_hook`) raises `_StopRecomputationError` once the count is reached, so the
    recomputation stops at the pack that matches the forward's last one. Autograd packs an op's saved
    inputs before its kernel runs and its saved outputs after: ops after the last pack, and the last
    op itself when only its inputs are saved, are not recomputed. An MLP block `x + fc2(gelu(fc1(ln(x))))`
    recomputes fc1 but not fc2 (fc2 saves only its input): half its matmul FLOPs. A segment's inner
    blocks are recomputed whole. The trace without checkpointing records the node count and the
    running module at every pack (memplan.estimator.saved_tensors); the recomputation of a..b runs the
    segment's nodes before its last pack.
    """
    packs = traced.saved_packs
    if not packs:
        return (), ()
    count = len(order)
    forward_end = traced.forward_end
    block_of: dict[str | None, int | None] = {}
    last_pack: list[int | None] = [None] * count
    for node_count, module in packs:
        if node_count > forward_end:
            continue
        if module not in block_of:
            block_of[module] = next((j for j in range(count) if _in_module(module, order[j])), None)
        j = block_of[module]
        if j is not None:
            last_pack[j] = node_count if last_pack[j] is None else max(last_pack[j], node_count)
    cumulative = [0]
    for node in nodes[: max(ends) + 1]:
        cumulative.append(cumulative[-1] + node_flops(node))
    recomputed, growth = [], []
    for a in range(count):
        base = entry_bytes[a]
        stop = starts[a]  # the recomputation runs nodes starts[a] .. stop - 1
        flops_row, growth_row, highest = [], [], None
        for b in range(a, count):
            if last_pack[b] is not None and last_pack[b] > stop:
                run_to = min(last_pack[b], ends[b] + 1)
                span = timeline[stop:run_to]
                if span:
                    highest = max(span) if highest is None else max(highest, max(span))
                stop = max(stop, run_to)
            flops_row.append(cumulative[stop] - cumulative[starts[a]])
            growth_row.append(0 if highest is None else max(0, highest - base))
        recomputed.append(tuple(flops_row))
        growth.append(tuple(growth_row))
    return tuple(recomputed), tuple(growth)


def model_peak_bytes(costs: ChainCosts, segments: list[tuple[int, int]]) -> int:
    """The peak the cost model predicts for checkpointing `segments` ((first, last) candidate indices).

    Written independently of the solvers, which must agree with it (tests brute-force small chains).
    """
    count = len(costs)
    segment_of: dict[int, tuple[int, int]] = {j: (a, b) for a, b in segments for j in range(a, b + 1)}
    peak = 0
    for level in range(count + 1):
        before = sum(costs.freed_bytes(a, b) for a, b in segments if b < level)
        within = holding = 0
        if level < count and level in segment_of:
            first = segment_of[level][0]
            # inside a checkpoint's forward: what its earlier blocks freed, less its state, taken as it starts
            within = costs.freed_bytes(first, level - 1) if first < level else -costs.checkpoint_state_bytes
            holding = costs.checkpoint_state_bytes  # and held through its blocks' backward
        peak = max(
            peak,
            costs.forward_level_peak[level] - before - within,
            costs.backward_level_peak[level] - before + holding,
        )
    for a, b in segments:
        before = sum(costs.freed_bytes(x, y) for x, y in segments if y < a)
        recompute = costs.recompute_base_bytes(b) - before - costs.freed_bytes(a, b) + costs.growth_bytes(a, b)
        peak = max(peak, recompute)
    return peak
