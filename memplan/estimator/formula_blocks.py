"""Where a backward formula's temporaries are let go: the blocks of a generated formula (one C++ expression per
input's gradient), the statements of a manual one, and what validate_outputs reads after it (memplan.estimator.
liveness reads them for each autograd Node's ops)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memplan.estimator.opgraph import OpNode

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

    # where a statement that an in-place op on a made result begins ends the one before (_statement_starts)
    statement_ends: tuple[int, ...] = ()
    # what a manual formula's named locals hold (`auto pdf = ...`): alive until it returns (MANUAL_STATEMENTS)
    named_locals: frozenset[Any] = frozenset()

    def end_after(self, index: int, born: int | None = None) -> int:
        """The end of the block a temporary last read at `index` belongs to; `born`: where it was made. One made after
        a result, in a statement on it, dies at that statement's end."""
        ends = self.ends
        if born is not None and self.statement_ends and born > self.ends[0]:
            ends = tuple(sorted({*self.ends, *self.statement_ends}))
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
    statement_ends = _statement_starts(own, results, nodes, storages, born, index_of)
    named_locals: set[Any] = set()
    manual = _manual_statements(node_name, own, nodes)
    if manual is not None:
        for last, named in manual:
            statement_ends.append(last)
            if named:
                named_locals.update(key for key, _ in storages[last])
    return FormulaBlocks(
        frozenset(results),
        (*ends, formula[own_end - 1]),
        frozenset(validated_from - set(returned)),
        tuple(sorted(statement_ends)),
        frozenset(named_locals),
    )


# Manual formulas of several C++ statements, by autograd Node: each statement's ops (as the trace sees them, aliases
# and result_type aside) and whether its value is a named local (`auto x = ...;`, alive until the function returns)
# or the formula's result. A temporary dies at its statement's end; the statements must match the formula's last
# ops exactly, or the formula keeps the blocks formula_blocks gives it.
_M = torch.ops.aten
MANUAL_STATEMENTS: dict[str, tuple[tuple[tuple[Any, ...], bool], ...]] = {
    # gelu_double_backward, approximate='none' (torch/csrc/autograd/FunctionsManual.cpp, torch 2.13), the gradient of
    # gelu_backward's `self`, after its `grad_output` block (`gelu_backward(grad, self, approximate)`):
    #   auto input_sq = input * input;
    #   auto pdf = kBeta * at::exp(-0.5 * input_sq);
    #   auto dgrad_dInput = 2 * pdf - input_sq * pdf;   (the right operand computed first)
    #   auto gI = ggI * gO * dgrad_dInput;
    # Held to the formula's end, `-0.5 * input_sq`, its exp, `2 * pdf`, `input_sq * pdf` made a gradient penalty
    # through nn.GELU 19% high (tests/test_double_backward.py).
    "GeluBackwardBackward0": (
        ((_M.mul.Tensor,), True),
        ((_M.mul.Scalar, _M.exp.default, _M.mul.Scalar), True),
        ((_M.mul.Tensor, _M.mul.Scalar, _M.sub.Tensor), True),
        ((_M.mul.Tensor, _M.mul.Tensor), False),
    ),
}
_ALIASES = frozenset({_M.detach.default, _M.result_type.Tensor, _M.result_type.Scalar})


def _manual_statements(node_name: str | None, own: list[int], nodes: list[OpNode]) -> list[tuple[int, bool]] | None:
    """For a formula in MANUAL_STATEMENTS whose last ops are its statements': each statement's last op, and whether
    it makes a named local."""
    statements = MANUAL_STATEMENTS.get(node_name or "")
    if statements is None:
        return None
    ops = [index for index in own if nodes[index].target not in _ALIASES]
    wanted = [target for targets, _ in statements for target in targets]
    if len(ops) < len(wanted) or [nodes[index].target for index in ops[-len(wanted) :]] != wanted:
        return None
    found, position = [], len(ops) - len(wanted)
    for targets, named in statements:
        position += len(targets)
        found.append((ops[position - 1], named))
    return found


def _writes_its_first_argument(node: OpNode) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


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
        if not made or not made <= results or not _writes_its_first_argument(node):
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
