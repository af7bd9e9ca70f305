"""What bitsandbytes' 4-bit matmul allocates inside its op, where the trace sees only its output.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GEMM_4BIT = "bitsandbytes.gemm_4bit.default"


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
