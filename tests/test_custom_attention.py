"""--attn-impl reaches transformers models inside a custom nn.Module, and is refused where there are none."""

import pytest

from examples.long_document import CHUNK_TOKENS, CHUNKS
from memplan.api import estimate
from memplan.errors import UsageError

LONG_DOCUMENT = {
    "inputs": "examples.long_document:inputs",
    "loss": "examples.long_document:loss",
    "batch_size": 1,
    "device": "cuda",  # on CPU the masked SDPA falls back to the math kernel, which saves them too
}
DISTILBERT_LAYERS, DISTILBERT_HEADS = 6, 12  # DistilBertConfig() defaults


def test_eager_attention_saves_the_attention_probabilities():
    sdpa = estimate("examples.long_document:build", **LONG_DOCUMENT)
    eager = estimate("examples.long_document:build", attn_impl="eager", **LONG_DOCUMENT)
    # Eager attention keeps, per layer, softmax(QK^T) in fp32, the attention dropout's output (fp32)
    # and its bool mask (CUDA's fused native_dropout) for the backward pass. SDPA keeps none of them,
    # but its memory-efficient kernel keeps the padding mask made additive: fp32 [chunks, 1, seq, seq].
    probabilities = DISTILBERT_LAYERS * CHUNKS * DISTILBERT_HEADS * CHUNK_TOKENS * CHUNK_TOKENS * 4
    additive_masks = DISTILBERT_LAYERS * CHUNKS * CHUNK_TOKENS * CHUNK_TOKENS * 4
    expected = probabilities + probabilities + probabilities // 4 - additive_masks
    difference = eager.breakdown.activations - sdpa.breakdown.activations
    # Within 0.2%: what else differs (a few small per-layer tensors) is 1.5 MB of 1.6 GB.
    assert abs(difference - expected) <= 0.002 * expected, (difference, expected)


def test_attention_setting_without_transformers_models_is_refused():
    with pytest.raises(UsageError, match="applies to transformers models"):
        estimate("tests.zoo_models:tied_lm", inputs="tests.zoo_models:token_inputs", attn_impl="eager", device="cpu")
