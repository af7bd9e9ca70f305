"""The memory layout of bitsandbytes' blockwise 8-bit Adam, for when bitsandbytes is absent.

Source: bitsandbytes/optim/optimizer.py, `Optimizer2State.init_state` (0.43 and later): a parameter
with at least `min_8bit_size` (4096) elements keeps `state1`/`state2` as uint8 tensors of its shape
plus float32 `absmax1`/`absmax2` with one entry per 256-element block; smaller parameters keep
float32 `state1`/`state2`. The two 256-entry float32 quantization maps ("dynamic", "udynamic") are
shared by all parameters. The update is one fused CUDA kernel
(`optimizer_update_8bit_blockwise`) writing in place, so the step allocates no temporaries.

The paged variant (`PagedAdamW8bit`, HF's `paged_adamw_8bit`, the usual QLoRA optimizer) takes
each state buffer of a parameter with at least 100,000 elements from `F.get_paged`: CUDA unified
memory (cudaMallocManaged), outside torch's caching allocator, which the driver moves to host
memory when the GPU runs short (`Optimizer8bit.get_state_buffer`). Smaller parameters' buffers,
the absmax and the maps are ordinary tensors; on the CPU nothing is paged (the same function
falls back to `zeros_like` there).
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 256
QMAP_ENTRIES = 256
# Optimizer8bit.get_state_buffer: `if not self.is_paged or p.numel() < 1e5` gives an ordinary tensor.
PAGED_MIN_NUMEL = 100_000


def paged_state_bytes(params: list[torch.Tensor]) -> int:
    """Bytes of the paged optimizer's state in unified memory: the two uint8 moments of every
    parameter with at least PAGED_MIN_NUMEL elements (all of which are past MIN_8BIT_SIZE)."""
    return sum(2 * param.numel() for param in params if param.numel() >= PAGED_MIN_NUMEL)


class Adam8bitLayout(Optimizer):
    """State tensors shaped and typed as bitsandbytes' Adam8bit; an in-place update without temporaries.

    The update is not bitsandbytes' quantized arithmetic: memplan needs its memory, not its numbers.
    """

    def __init__(self, params, lr: float = 1e-3, paged: bool = False) -> None:
        super().__init__(params, {"lr": lr})
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None
        self.paged = paged  # moments of large parameters in unified memory: not torch's to count

    def _init_state(self, param: torch.Tensor) -> dict:
        state: dict = {"step": 0}
        numel = param.numel()
        if numel < MIN_8BIT_SIZE:
            state["state1"] = torch.zeros_like(param, dtype=torch.float32)
            state["state2"] = torch.zeros_like(param, dtype=torch.float32)
            return state
        if self._qmaps is None:
            self._qmaps = (
                torch.zeros(QMAP_ENTRIES, dtype=torch.float32, device=param.device),
                torch.zeros(QMAP_ENTRIES, dtype=torch.float32, device=param.device),
            )
        blocks = numel // BLOCK_SIZE + bool(numel % BLOCK_SIZE)
        if not (self.paged and numel >= PAGED_MIN_NUMEL):  # paged: made outside torch's allocator
            state["state1"] = torch.zeros_like(param, dtype=torch.uint8)
            state["state2"] = torch.zeros_like(param, dtype=torch.uint8)
        state["qmap1"] = self._qmaps[0]
        state["qmap2"] = self._qmaps[1]
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=param.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=param.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param not in self.state or not self.state[param]:
                    self.state[param] = self._init_state(param)
                self.state[param]["step"] += 1
                param.add_(param.grad, alpha=-group["lr"])
        return None
