"""The advice printed when not even batch size 1 fits names what lowers the part that is over.

Budgets are placed between the estimate's own parts (state, optimizer-step peak, whole peak), so
each case is over budget for one reason only; the advice must name a remedy for that part and
must not offer checkpointing where checkpointing cannot help.
"""

from memplan.advice import when_nothing_fits
from memplan.api import estimate

SETTINGS = dict(batch_size=1, seq_len=128, optimizer="adamw", device="cpu")


def test_each_reason_gets_its_own_advice(tiny_model_dirs):
    result = estimate(tiny_model_dirs["gpt2"], **SETTINGS)
    state = result.breakdown.parameters + result.breakdown.optimizer_state
    optimizer_peak = result.phase_peak_bytes["optimizer"]
    assert state < optimizer_peak < result.peak_bytes  # activations make this step's peak

    state_advice = when_nothing_fits(result, state - 1)
    assert "no batch size fits one device" in state_advice and "--parallel fsdp --world-size N" in state_advice
    assert "adam8bit" in state_advice
    assert "--lora RANK" in state_advice
    assert "--checkpoint" not in state_advice

    step_advice = when_nothing_fits(result, (state + optimizer_peak) // 2)
    assert "optimizer step" in step_advice and "--optimizer-impl for-loop" in step_advice
    assert "--checkpoint" not in step_advice

    activation_advice = when_nothing_fits(result, (optimizer_peak + result.peak_bytes) // 2)
    assert "--checkpoint all" in activation_advice and "--precision amp-bf16" in activation_advice
    assert "--seq-len" in activation_advice


def test_advice_leaves_out_what_is_already_set(tiny_model_dirs):
    result = estimate(tiny_model_dirs["gpt2"], **{**SETTINGS, "checkpoint": "all", "precision": "amp-bf16"})
    advice = when_nothing_fits(result, result.phase_peak_bytes["optimizer"] + 1)
    assert "--checkpoint all" not in advice and "amp-bf16" not in advice
    assert "--precision bf16" in advice


def test_lora_advice_does_not_offer_to_shrink_a_sliver_of_optimizer_state(tiny_model_dirs):
    """With rank-4 adapters AdamW keeps 2 x 4 B x 2,048 adapter parameters (+ step counts) against
    ~0.5 MiB of weights: 8-bit Adam would save nothing worth saying, nor would --lora again."""
    result = estimate(tiny_model_dirs["gpt2"], **SETTINGS, lora_rank=4)
    assert 4 * result.breakdown.optimizer_state < result.breakdown.parameters
    advice = when_nothing_fits(result, result.breakdown.parameters - 1)
    assert "adam8bit" not in advice and "--lora" not in advice and "--precision bf16" in advice
    assert "--quantize nf4" in advice  # the frozen weights are what is over: QLoRA shrinks them
    quantized = estimate(tiny_model_dirs["gpt2"], **SETTINGS, lora_rank=4, quantize="nf4")
    assert "--quantize" not in when_nothing_fits(quantized, quantized.breakdown.parameters - 1)


def test_a_sharded_rank_is_told_to_shard_further(tiny_model_dirs):
    result = estimate(tiny_model_dirs["gpt2"], **SETTINGS, parallel="fsdp", world_size=2)
    state = result.breakdown.parameters + result.breakdown.optimizer_state
    advice = when_nothing_fits(result, state - 1)
    assert "more ranks (--world-size" in advice and "--parallel fsdp" not in advice
    assert "--offload params" in advice  # the state can leave the GPU: FSDP2's CPU offload


def test_a_ddp_rank_whose_state_does_not_fit_is_pointed_at_sharding_on_the_same_ranks():
    result = estimate("tests.ddp_models:stack", inputs="tests.ddp_models:rows", loss="tests.ddp_models:mean_square",
                      batch_size=4, device="cpu", parallel="ddp", world_size=4)  # fmt: skip
    advice = when_nothing_fits(result, result.breakdown.parameters)
    assert "--parallel zero1" in advice and "fsdp" in advice and "--world-size N" not in advice


def test_a_zero1_rank_whose_state_does_not_fit_is_pointed_at_fsdp():
    result = estimate("tests.ddp_models:stack", inputs="tests.ddp_models:rows", loss="tests.ddp_models:mean_square",
                      batch_size=4, device="cpu", parallel="zero1", world_size=4)  # fmt: skip
    advice = when_nothing_fits(result, result.breakdown.parameters)
    assert "--parallel fsdp on the same ranks" in advice and "zero1" not in advice


def test_a_peak_made_of_workspaces_is_told_to_shrink_them():
    """tiny-gpt2 on the cuda target: cuBLAS's two 32 MiB workspaces are 64 of its 66.7 MiB peak, and the advice
    was "activations make the peak: try --checkpoint all" (its activations at the peak: the loss the loop keeps
    bound through the step, one 512 B block). Following the new advice fits the same budget."""
    result = estimate("tiny-gpt2", batch_size=1, seq_len=32)
    assert result.breakdown.workspaces == 2 * 32 * 2**20 and result.breakdown.activations == 512
    advice = when_nothing_fits(result, 67 * 2**20)
    assert advice.startswith("workspaces take 64.00 MiB") and "--cublas-workspace-config :16:8" in advice
    assert "--checkpoint" not in advice
    assert estimate("tiny-gpt2", batch_size=1, seq_len=32, cublas_workspace_config=":16:8", budget="67MiB").fits


def test_a_peak_made_of_deepspeed_s_buckets_is_told_to_shrink_them():
    """A ZeRO-2 rank of tiny-gpt2 with DeepSpeed's default 500,000,000-element reduce bucket (1.86 of its 1.87 GiB
    peak): the advice was "activations make the peak: try --checkpoint all", which left the peak where it was.
    Following the new advice fits the same budget."""
    zero2 = {"zero_optimization": {"stage": 2}}
    result = estimate("tiny-gpt2", batch_size=2, seq_len=64, device="cpu", parallel="zero2", world_size=2,
                      deepspeed_config=zero2)  # fmt: skip
    assert result.breakdown.communication >= 500_000_000 * 4 - 2**20  # the float32 bucket, less the last MiB
    advice = when_nothing_fits(result, 2**30)
    assert advice.startswith("DeepSpeed's buckets take 1.86 GiB") and "zero_optimization.reduce_bucket_size" in advice
    assert "--checkpoint" not in advice
    smaller = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1_000_000}}
    assert estimate("tiny-gpt2", batch_size=2, seq_len=64, device="cpu", parallel="zero2", world_size=2,
                    deepspeed_config=smaller, budget="1GiB").fits  # fmt: skip
