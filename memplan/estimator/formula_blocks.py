"""Where a backward formula's temporaries are let go: the blocks of a generated formula (one C++ expression per
input's gradient), the statements of a manual one, and what validate_outputs reads after it (memplan.estimator.
liveness reads them for each autograd Node's ops)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memplan.estimator.manual_formulas import ARGUMENTS, BEGIN, END, LOCAL, MANUAL_STATEMENTS
from memplan.estimator.opgraph import OpNode
from memplan.estimator.regenerated_views import writes_first_argument

# What validate_outputs (torch/csrc/autograd/engine.cpp) runs on a Node's outputs after its formula returned: sum_to
# where an output's shape differs from its input's, a cast where its dtype does, and the views sum_to ends with.
_VALIDATE_OUTPUT_OPS = frozenset(
    {
        torch.ops.aten.sum.default,
        torch.ops.aten.sum.dim_IntList,
        torch.ops.aten._to_copy.default,
        torch.ops.aten.view.default,
        torch.ops.aten.squeeze.dim,
        torch.ops.aten.squeeze.dims,
        torch.ops.aten._unsafe_view.default,
    }
)


@dataclass(frozen=True)
class FormulaBlocks:
    """Where a backward formula's temporaries are let go. A generated formula computes each input's gradient in a
    block of its own, one C++ expression (`grad_result = -grad * ((self / other) / other)`), whose temporaries
    live until the expression ends, when its result is made: past their last use, but not to the formula's end
    (DivBackward0 frees `self / other` and `-grad` as its first block's result is made, before its second
    block; tests/test_liveness_formulas.py). `results`: what the blocks made (the Node's outputs, and what
    validate_outputs read to make them); `ends`: the graph nodes that made them, in order, then the formula's
    last own node (before validate_outputs' ops)."""

    results: frozenset[Any]
    ends: tuple[int, ...]
    # what validate_outputs cast or summed into a returned output: the engine replaces the output with the new
    # tensor as it goes (`grad = grad.to(...)`), which frees the old one after that op
    validated_from: frozenset[Any]

    # `ends` with where a statement that an in-place op on a made result begins ends the one before
    # (_statement_starts), in order: the ends of what the formula makes after its first result
    ends_with_statements: tuple[int, ...] = ()
    # what a manual formula's named locals hold (`auto pdf = ...`), each with the op its scope ends at: the formula's
    # end, or the end of the block (`if`, a lambda's body) that declares it (MANUAL_STATEMENTS)
    named_locals: Mapping[Any, int] = field(default_factory=dict)
    # a manual formula's statements (MANUAL_STATEMENTS): each one's last op with its depth in blocks, in order, and
    # the depth of the statement each of their ops belongs to
    manual_ends: tuple[tuple[int, int], ...] = ()
    manual_depths: Mapping[int, int] = field(default_factory=dict)

    def end_after(self, index: int, born: int | None = None) -> int:
        """The end of the block a temporary last read at `index` belongs to; `born`: where it was made. One made after
        a result, in a statement on it, dies at that statement's end. One a manual formula's statement made dies at
        the end of the first statement, as deep as that one or less, that ends at or after `index`: a temporary of a
        call's arguments outlives the statements of the called lambda's body (`f(x, at::ones({}))`)."""
        if born is not None and born in self.manual_depths:
            depth = self.manual_depths[born]
            for end, end_depth in self.manual_ends:
                if end >= index and end_depth <= depth:
                    return end
            return self.ends[-1]
        ends = self.ends
        if born is not None and self.ends_with_statements and born > self.ends[0]:
            ends = self.ends_with_statements
        for end in ends:
            if end >= index:
                return end
        return ends[-1]


def formula_blocks(
    formula: list[int],
    returned: frozenset[Any],
    nodes: list[OpNode],
    storages: list[list[tuple[Any, int]]],
    born: dict[Any, int],
    index_of: dict[OpNode, int],
    node_name: str | None = None,
) -> FormulaBlocks | None:
    """The blocks of one Node's formula (`formula`: its graph nodes; `returned`: the storages it returned), or None
    where the formula made none of what it returned (nothing to tell its blocks by)."""
    results = set(returned)
    validated_from: set[Any] = set()
    own_end = len(formula)
    # validate_outputs' ops come last: each makes a returned storage (or a view of one) from another the formula made
    while own_end > 1:
        node = nodes[formula[own_end - 1]]
        made = {key for key, _ in storages[formula[own_end - 1]]}
        if not made or not made <= results or node.target not in _VALIDATE_OUTPUT_OPS:
            break
        for source in node.all_input_nodes:
            sources = {key for key, _ in storages[index_of[source]]}
            validated_from.update(sources - made)
            results.update(sources)
        own_end -= 1
    own = formula[:own_end]
    ends = [index for index in own if any(born.get(key) == index and key in results for key, _ in storages[index])]
    if not ends:
        return None
    block_ends = (*ends, formula[own_end - 1])
    statement_ends = _statement_starts(own, results, nodes, storages, born, index_of)
    named_locals: dict[Any, int] = {}
    manual = _manual_statements(node_name, own, nodes)
    if manual is not None:
        for last, scope_end in manual.locals:
            for key, _ in storages[last]:
                if key not in results and born.get(key) in manual.depths:  # a result is held until the formula returns
                    named_locals[key] = formula[-1] if scope_end is None else scope_end
    return FormulaBlocks(
        frozenset(results),
        block_ends,
        frozenset(validated_from - set(returned)),
        tuple(sorted({*block_ends, *statement_ends})) if statement_ends else (),
        named_locals,
        manual.ends if manual is not None else (),
        manual.depths if manual is not None else {},
    )


_ALIASES = frozenset(
    {torch.ops.aten.detach.default, torch.ops.aten.result_type.Tensor, torch.ops.aten.result_type.Scalar}
)


@dataclass(frozen=True)
class _Manual:
    """Where a manual formula's statements matched: each statement's last op and depth (FormulaBlocks.manual_ends),
    the depth of each of their ops, and each named local's last op with where its scope ends (None: the formula's
    end)."""

    ends: tuple[tuple[int, int], ...]
    depths: dict[int, int]
    locals: tuple[tuple[int, int | None], ...]


def _manual_statements(node_name: str | None, own: list[int], nodes: list[OpNode]) -> _Manual | None:
    """The statements of the longest variant in MANUAL_STATEMENTS whose ops are the formula's last ops, or None."""
    ops = [index for index in own if nodes[index].target not in _ALIASES]
    targets = [nodes[index].target for index in ops]
    found = None
    for variant in MANUAL_STATEMENTS.get(node_name or "", ()):
        wanted = [target for statement in variant if not isinstance(statement, str) for target in statement[0]]
        if len(wanted) > len(ops) or targets[len(ops) - len(wanted) :] != wanted:
            continue
        if found is None or len(wanted) > len(found[1]):
            found = (variant, wanted)
    if found is None:
        return None
    variant, wanted = found
    position = len(ops) - len(wanted)
    last = ops[position - 1] if position else own[0]  # the op before the statements
    ends: list[tuple[int, int]] = []
    depths: dict[int, int] = {}
    declared: list[list[int]] = [[]]  # the named locals' last ops, by open block
    local_ends: list[tuple[int, int | None]] = []
    for statement in variant:
        depth = len(declared) - 1
        if statement == BEGIN:
            declared.append([])
        elif statement == END:
            local_ends.extend((local, last) for local in declared.pop())
            ends.append((last, depth - 1))  # the block is a statement of the scope around it
        else:
            statement_ops, kind = statement
            for index in ops[position : position + len(statement_ops)]:
                depths[index] = depth
            position += len(statement_ops)
            if statement_ops:
                last = ops[position - 1]
            if kind == LOCAL:
                declared[-1].append(last)
            if kind != ARGUMENTS:  # the call's statement ends with the lambda's body (its END)
                ends.append((last, depth))
    local_ends.extend((local, None) for local in declared.pop())
    return _Manual(tuple(ends), depths, tuple(local_ends))


def _statement_starts(
    own: list[int],
    results: set[Any],
    nodes: list[OpNode],
    storages: list[list[tuple[Any, int]]],
    born: dict[Any, int],
    index_of: dict[OpNode, int],
) -> list[int]:
    """Where a new C++ statement of a manual formula begins, each as the index of the op before it: an in-place op on
    a result already made (`grad_input.mul_(grad);`, `grad_input.div_(input.sym_numel());` in
    binary_cross_entropy_with_logits_backward, torch/csrc/autograd/FunctionsManual.cpp) that reads no temporary the
    formula made since the statement before. Such an op cannot continue an expression that made a temporary it does
    not read: a temporary's expression ends before it (or the op chains on, `.sub_(t)` reading nothing new, and the
    ops between allocate nothing). The temporaries of the statement before die there (C++ destroys a full
    expression's temporaries at its end), not at the formula's last op: BCE with pos_weight's `input.sigmoid()`
    (`t.add(1).sub_(target).mul_(input.sigmoid()).sub_(t)`) was held through `div_`'s wrapped number, 12 B over."""
    own_set = frozenset(own)
    starts = []
    since = own[0] if own else 0  # the first op of the current statement
    for position, index in enumerate(own):
        node = nodes[index]
        made = {key for key, _ in storages[index]}
        if not made or not made <= results or not writes_first_argument(node.target):
            continue
        if any(born.get(key, index) >= index for key in made):
            continue  # it makes the result: the expression that made it
        reads_new = any(
            born.get(key) is not None and since <= born[key] < index and born[key] in own_set and key not in results
            for source in node.all_input_nodes
            for key, _ in storages[index_of[source]]
        )
        if not reads_new and position > 0:
            starts.append(own[position - 1])
            since = index
    return starts
