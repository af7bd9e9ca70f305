"""A Python number assigned into a tensor: `ids[:, 0] = start` (transformers' `shift_tokens_right` of BART,
Marian, mBART, Pegasus; T5's `_shift_right`).

THPVariable_setitem (torch/csrc/autograd/python_variable_indexing.cpp) makes the number a 0-dim tensor of the
target's dtype with `valueToTensor` -> `at::indexing::scalarToTensor`, which on a CPU target calls
`scalar_tensor_static`: a real CPU tensor allocated without dispatching, freed as the assignment returns. A
dispatch mode first sees it as the `src` of the `copy_` (or `index_put_`) the assignment runs, a tensor no recorded
op made, which memplan's recorder keeps as a graph constant: live for the whole step, the target's itemsize
too high per assignment (8 B on every seq2seq model's step). It is now live from that op to when the real tensor
is let go. validate's counter (memplan.measure.cpu) counted such a tensor, read by an op before any op made it, as
one the iteration began with, likewise; it now counts it until it is freed. Truth: the same step run plainly,
measured by the CPU allocator's events (tests/hand_measure.py).
"""

import torch
from torch import nn

from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.measure.cpu import measure_cpu
from memplan.settings import TrainingSettings
from tests.hand_measure import profiled_third_iteration_peak
from tests.module_specs import loss_returning_spec

WIDTH, COLUMNS, BATCH = 16, 6, 8


class _Shifted(nn.Module):
    """Writes one number into each of its output's first columns, as a shift right writes the start token."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.zeros(x.shape[0], WIDTH, dtype=torch.long)
        for column in range(COLUMNS):
            ids[:, column] = column + 1  # an int64 0-dim tensor, live while the assignment runs
        return (self.fc(x) * ids).square().sum()


SPEC = loss_returning_spec("shifted", _Shifted, (WIDTH,))


def _plain_run_peak(model_class: type[nn.Module], optimizer_class: type[torch.optim.Optimizer]) -> int:
    def build():  # type: ignore[no-untyped-def]
        model = model_class()
        optimizer = optimizer_class(model.parameters(), lr=0.1)
        batch = torch.randn(BATCH, WIDTH)
        build.kept = (model, optimizer, batch)

        def iteration() -> None:  # the loss bound through the step, as the canonical loop binds it
            loss = model(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return iteration

    return profiled_third_iteration_peak(build)


def test_a_number_assigned_into_a_tensor_lives_only_while_the_assignment_runs():
    measured = _plain_run_peak(_Shifted, torch.optim.AdamW)
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="adamw")
    assert simulate(trace_step(SPEC, settings)).peak_bytes == measured
    assert measure_cpu(SPEC, settings).peak_bytes == measured


def test_t5s_shifted_labels_are_exact(tiny_model_dirs):
    """T5's `_shift_right` writes decoder_start_token_id into the shifted labels' first column: 8 B high before."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from memplan.models.source import resolve_model
    from tests.hand_measure import profiled_causal_lm_peak
    from tests.zoo import TINY_HF_CONFIGS

    spec = resolve_model(tiny_model_dirs["t5"])
    settings = spec.settings_for(TrainingSettings(batch_size=2, seq_len=32, target_len=16, device="cpu"))
    config = AutoConfig.for_model(**TINY_HF_CONFIGS["t5"], use_cache=False)
    vocab = TINY_HF_CONFIGS["t5"]["vocab_size"]

    def batch() -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, vocab, (2, 32)), "labels": torch.randint(0, vocab, (2, 16))}

    measured = profiled_causal_lm_peak(lambda: AutoModelForSeq2SeqLM.from_config(config), batch)
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
    assert measure_cpu(spec, settings).peak_bytes == measured


class _LateConstant(nn.Module):
    """A plain tensor attribute (neither parameter nor buffer) first read after the forward's peak: a 64 KiB
    temporary made from the batch and summed away."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.scale = torch.full((2048,), 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        corner = x.repeat(1, 128)[:, :WIDTH] * 2  # the repeat: [8, 2,048] float32, 64 KiB, freed at once
        return (self.fc(x) + corner).sum() * self.scale.sum()


def test_validate_s_counter_counts_a_constant_first_read_after_the_peak_through_the_iteration():
    """memplan.measure.cpu counts a tensor first read during the iteration until it is freed; one still alive after
    it existed before it too, and counts at the peak before its first read (8 KiB here)."""
    spec = loss_returning_spec("late-constant", _LateConstant, (WIDTH,))
    measured = _plain_run_peak(_LateConstant, torch.optim.SGD)
    settings = TrainingSettings(batch_size=BATCH, device="cpu", optimizer="sgd")
    assert measure_cpu(spec, settings).peak_bytes == measured
    assert simulate(trace_step(spec, settings)).peak_bytes == measured
