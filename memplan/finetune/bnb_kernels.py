"""What bitsandbytes' 4-bit and 8-bit matmuls allocate inside their ops, where the trace sees only
their outputs, and how the 8-bit one is traced as it runs on CUDA.

4 bits (QLoRA):

`bitsandbytes::gemm_4bit` (bitsandbytes >= 0.50; `MatMul4Bit.forward`) is one op to the trace: its
fake implementation (bitsandbytes/_ops.py) makes the output and nothing else. Its kernels:
- `_gemm_4bit_default_impl` (backends/default/ops.py; the CPU's kernel) and CUDA's
  `_dequant_linear_fallback` (backends/cuda/ops.py) dequantize first. With double quantization
  the absmax comes back as float32: `dequantize_blockwise` into one buffer, `+ absmax_offset`
  into a second. The CPU's kernel frees the first at once (a temporary of one expression); CUDA's
  keeps it in a local (`absmax_dq`) until it returns. Then the whole weight is dequantized into an
  (N, K) tensor in the input's dtype, then `F.linear`. So while the output is made, the float32
  absmax (twice on CUDA) and the dequantized weight are live: those are the transients here. Releases before 0.50 always
  ran `F.linear(A, dequantize_4bit(B).to(A.dtype).t())`: the same requests.
- CUDA's fused `cgemm_4bit_*` kernel, which reads the packed weight directly, can be chosen only
  where M (rows of the input) is at most 1536 and K is a multiple of the blocksize
  (`_gemm_4bit_custom_max_m`); below that bnb picks by GPU architecture and shape
  (`_gemm_4bit_use_custom_cuda`), which needs a real CUDA device to import. memplan counts the
  dequantizing kernel there too, the larger of the two, and its estimate's note says so.

8 bits (LLM.int8(), `--quantize int8`; bitsandbytes 0.50, autograd/_functions.py and backends/):
- Which autograd Function: `bnb.matmul` runs MatMul8bitFp (dequantize the weight, `F.linear`) when
  training on a CPU or XPU tensor and MatMul8bitLt everywhere else. memplan traces on fake CPU
  tensors, so for a cuda target `int8_matmul_as_on_cuda` calls MatMul8bitLt as CUDA does.
- MatMul8bitLt with a frozen weight (LoRA) quantizes the input row-wise (`int8_vectorwise_quant` of
  its float16 copy) and, with the outlier threshold transformers sets (llm_int8_threshold=6.0),
  runs `int8_mixed_scaled_mm`: input columns holding a value of at least 6 are multiplied in 16 bits.
  Which columns those are depends on the data. bitsandbytes' own fake implementations give them an
  unbacked size that a trace without a ShapeEnv cannot hold (and give the kept input columns,
  `subA`, the wrong shape); while tracing for cuda memplan registers its own, with
  OUTLIER_COLUMN_FRACTION of the columns, and says so in the estimate's notes.
- What the CUDA kernels allocate inside those ops is `int8_scratch` (what, bytes) per op.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

GEMM_4BIT = "bitsandbytes.gemm_4bit.default"
INT8_VECTORWISE_QUANT = "bitsandbytes.int8_vectorwise_quant.default"
INT8_MIXED_SCALED_MM = "bitsandbytes.int8_mixed_scaled_mm.default"
INT8_SCALED_MM = "bitsandbytes.int8_scaled_mm.default"
# int8_double_quant is left out: MatMul8bitLt runs it only for a weight that trains (not LoRA's);
# bitsandbytes' own fake implementation then fails the trace (its outlier count is data-dependent).
INT8_OPS = (INT8_VECTORWISE_QUANT, INT8_MIXED_SCALED_MM, INT8_SCALED_MM)
# The share of an int8 layer's input columns assumed to hold an outlier (|value| >= threshold).
# LLM.int8() (Dettmers et al. 2022, arXiv:2208.07339) reports that "more than 99.9% of values are
# multiplied in 8-bit": under 0.1% of the columns. bitsandbytes takes a column as an outlier when any
# row of the batch holds one, which larger batches make more likely, so memplan assumes ten times
# that. It sizes only the 16-bit columns kept for the backward (`subA`, rows x columns) and the
# weight columns dequantized beside them: 1% of the layer's input in the input's dtype.
OUTLIER_COLUMN_FRACTION = 0.01


def is_gemm_4bit(target: object) -> bool:
    """Whether an FX node's target is bitsandbytes' 4-bit matmul (without importing bitsandbytes)."""
    return str(target) == GEMM_4BIT


def gemm_4bit_scratch(args: Sequence[object], kwargs: dict[str, object], device: str) -> tuple[tuple[str, int], ...]:
    """(what, bytes) the dequantizing kernel allocates and frees around its output on `device`
    ("cpu" or "cuda"), for gemm_4bit's arguments (A, B, shapeB, absmax, blocksize, quant_type,
    bias, absmax_8bit, ...)."""
    activation, (rows, columns) = args[0], args[2]
    absmax_8bit = args[7] if len(args) > 7 else kwargs.get("absmax_8bit")
    assert isinstance(activation, torch.Tensor)
    requests = []
    if isinstance(absmax_8bit, torch.Tensor):  # double quantization: the float32 absmax, rebuilt
        copies = 2 if device == "cuda" else 1
        requests += [("4-bit absmax, dequantized", absmax_8bit.numel() * 4)] * copies
    requests.append(("4-bit weight, dequantized", int(rows) * int(columns) * activation.element_size()))
    return tuple(requests)


def outlier_columns(in_features: int) -> int:
    """How many input columns memplan assumes hold an outlier: OUTLIER_COLUMN_FRACTION, at least one."""
    return max(1, math.ceil(in_features * OUTLIER_COLUMN_FRACTION))


def is_int8_op(target: object) -> bool:
    return str(target) in INT8_OPS


def int8_scratch(target: Any, args: Sequence[object], kwargs: dict[str, object]) -> tuple[tuple[str, int], ...]:
    """(what, bytes) bitsandbytes' CUDA path allocates and frees inside one of its int8 ops, read off
    backends/cuda/ops.py and, for the ops with no CUDA kernel, backends/default/ops.py. Counted as
    live together with the op's output, which over-counts by up to one output-sized tensor where a
    request is freed before the output is made: the high side. `target` is the op (an OpOverload),
    whose schema (bitsandbytes/_ops.py) names its arguments."""
    name = str(target)
    names = [argument.name for argument in target._schema.arguments]
    arguments = dict(zip(names, args, strict=False)) | kwargs
    if name == INT8_VECTORWISE_QUANT:
        return _quantize_scratch(arguments)
    if name == INT8_SCALED_MM:
        activation, weight = arguments["A"], arguments["B"]
        assert isinstance(activation, torch.Tensor) and isinstance(weight, torch.Tensor)
        dtype = arguments.get("dtype") or torch.float16
        return _scaled_mm_scratch(activation.numel() // activation.shape[-1], weight.shape[0], dtype)  # type: ignore[arg-type]
    return _mixed_scaled_mm_scratch(arguments)


def _quantize_scratch(arguments: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """int8_vectorwise_quant's CUDA kernel, with a threshold: `outliers = A.abs() >= threshold`
    (|A| in A's dtype, then a bool mask, both A's shape), then `outliers.any(dim=0)` (one bool per
    column) before `argwhere` gives the output; the outputs (`row_stats`, `out_row`) are made
    first, so all of these are live with them."""
    activation, threshold = arguments["A"], arguments.get("threshold", 0.0)
    assert isinstance(activation, torch.Tensor)
    if not threshold > 0.0:
        return ()
    elements = activation.numel()
    return (
        ("int8 outliers: |input|", elements * activation.element_size()),
        ("int8 outliers: mask", elements),
        ("int8 outliers: columns", activation.shape[-1]),
    )


def _scaled_mm_scratch(rows: int, out_features: int, dtype: torch.dtype) -> tuple[tuple[str, int], ...]:
    """int8_scaled_mm (no CUDA kernel of its own: the default one): `int8_linear_matmul` makes the
    int32 product (rows x out_features; cuBLASLt's igemmlt runs with no workspace, csrc/ops.cu
    passes NULL, 0), then CUDA's `int8_mm_dequant` writes a float16 result and returns it cast to
    `dtype` (a copy unless float16)."""
    requests = [("int8 matmul: int32 product", rows * out_features * 4)]
    if dtype != torch.float16:
        requests.append(("int8 matmul: float16 result", rows * out_features * 2))
    return tuple(requests)


def _mixed_scaled_mm_scratch(arguments: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """int8_mixed_scaled_mm (the default kernel runs on CUDA): the outlier columns of the int8 weight
    (`CB[:, outlier_cols]`), dequantized to float32 in two steps (`A * stats * 1/127`) and cast
    to the input's dtype; then int8_scaled_mm; then `output.addmm(subA, subB)` makes the output
    anew, so the product before the outlier columns are added is one more request."""
    activation, weight, columns = arguments["A"], arguments["CB"], arguments.get("outlier_cols")
    assert isinstance(activation, torch.Tensor) and isinstance(weight, torch.Tensor)
    rows, out_features = activation.numel() // activation.shape[-1], weight.shape[0]
    requests = list(_scaled_mm_scratch(rows, out_features, activation.dtype))
    outliers = columns.numel() if isinstance(columns, torch.Tensor) else 0
    if outliers:
        weight_columns = out_features * outliers
        requests += [
            ("int8 outlier weight columns", weight_columns),
            ("int8 outlier weight columns, float32", weight_columns * 4),
            ("int8 outlier weight columns, float32 scaled", weight_columns * 4),
            ("int8 outlier weight columns, dequantized", weight_columns * activation.element_size()),
            ("int8 matmul before the outlier columns", rows * out_features * activation.element_size()),
        ]
    return tuple(requests)


@contextlib.contextmanager
def int8_matmul_as_on_cuda() -> Iterator[None]:
    """While tracing for a cuda target: bitsandbytes' 8-bit layers run MatMul8bitLt, as on CUDA, and
    its data-dependent outputs get sizes (OUTLIER_COLUMN_FRACTION). Nothing when bitsandbytes is
    not loaded (no model uses it)."""
    if "bitsandbytes" not in sys.modules:
        yield
        return
    import bitsandbytes
    from bitsandbytes.autograd._functions import MatMul8bitLt

    from memplan.finetune.quiet import bitsandbytes_quiet

    original_matmul = bitsandbytes.matmul

    def matmul(A, B, out=None, state=None, threshold=0.0, bias=None):  # type: ignore[no-untyped-def]
        # bnb.matmul as on a CUDA tensor (autograd/_functions.py): MatMul8bitFp only for cpu/xpu.
        state = state or bitsandbytes.MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return MatMul8bitLt.apply(A, B, out, bias, state)

    library = torch.library.Library("bitsandbytes", "FRAGMENT")
    try:
        for name, fake in _INT8_FAKES.items():
            # allow_override: bitsandbytes registered its own (the default is False on torch 2.11 and 2.12).
            torch.library.register_fake(f"bitsandbytes::{name}", fake, lib=library, allow_override=True)
        bitsandbytes.matmul = matmul
        with bitsandbytes_quiet():  # MatMul8bitLt warns at every call that it casts its input to float16
            yield
    finally:
        bitsandbytes.matmul = original_matmul
        library._destroy()


def _outlier_column_indices(activation: torch.Tensor, threshold: float) -> torch.Tensor | None:
    if threshold == 0.0:
        return None
    return activation.new_empty(outlier_columns(activation.shape[-1]), dtype=torch.int64)


def _vectorwise_quant_fake(A: torch.Tensor, threshold: float = 0.0):  # type: ignore[no-untyped-def]
    rows = A.numel() // A.shape[-1]
    return (
        torch.empty(A.shape, device=A.device, dtype=torch.int8),
        torch.empty(rows, device=A.device, dtype=torch.float32),
        _outlier_column_indices(A, threshold),
    )


def _mixed_scaled_mm_fake(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):  # type: ignore[no-untyped-def]
    """The output, and `subA = A[:, outlier_cols]` in A's dtype, as the default kernel returns them."""
    out = torch.empty((*CA.shape[:-1], CB.shape[0]), device=A.device, dtype=A.dtype)
    outliers = outlier_cols.numel() if outlier_cols is not None else 0
    kept_columns = A.new_empty((A.shape[0], outliers)) if outliers else A.new_empty(0)
    return out, kept_columns


_INT8_FAKES = {
    "int8_vectorwise_quant": _vectorwise_quant_fake,
    "int8_mixed_scaled_mm": _mixed_scaled_mm_fake,
}
