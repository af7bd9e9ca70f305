"""A plan's recompute FLOPs: what the checkpointed step really runs again (memplan.planner.plan)."""

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

import memplan

BATCH, SEQ = 4, 64


def _real_step_flops(directory, checkpointed: bool) -> int:
    """FLOPs of a real forward and backward on the CPU, counted by torch's own FlopCounterMode, with every
    decoder layer checkpointed by transformers itself (non-reentrant, its default) or not."""
    torch.manual_seed(0)
    # eager attention: FlopCounterMode has no formula for the CPU's fused SDPA kernel, which would hide the
    # attention's matmuls from the real count (memplan counts them)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), attn_implementation="eager")
    model.train()
    if checkpointed:
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops()


def test_the_all_blocks_recompute_is_what_a_real_checkpointed_llama_step_runs_again(tiny_model_dirs):
    """A non-reentrant checkpoint stops recomputing once it has what the backward needs: a Llama layer's last
    projection (down_proj), whose output nothing saves, is not run again. The plan counted every block's whole
    forward (18% over on tiny-llama); it reads the recompute off the traces now."""
    directory = tiny_model_dirs["llama"]
    plan = memplan.plan(directory, budget="1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", attn_impl="eager")
    every = next(option for option in plan.baselines if option.name == "all blocks")
    measured = _real_step_flops(directory, True) - _real_step_flops(directory, False)
    assert measured > 0
    assert every.recompute_flops == measured
