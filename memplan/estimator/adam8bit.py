"""The memory layout of bitsandbytes' blockwise 8-bit Adam, for when bitsandbytes is absent.

Source: bitsandbytes/optim/optimizer.py, `Optimizer2State.init_state` (0.43 and later): a parameter
with at least `min_8bit_size` (4096) elements keeps `state1`/`state2` as uint8 tensors of its shape
plus float32 `absmax1`/`absmax2` with one entry per 256-element block; smaller parameters keep
float32 `state1`/`state2`. The two 256-entry float32 quantization maps ("dynamic", "udynamic") are
shared by all parameters. The update is one fused CUDA kernel
(`optimizer_update_8bit_blockwise`) writing in place, so the step allocates no temporaries.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 256
QMAP_ENTRIES = 256


class Adam8bitLayout(Optimizer):
    """State tensors shaped and typed as bitsandbytes' Adam8bit; an in-place update without temporaries.

    The update is not bitsandbytes' quantized arithmetic: memplan needs its memory, not its numbers.
    """

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

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
        state["state1"] = torch.zeros_like(param, dtype=torch.uint8)
        state["qmap1"] = self._qmaps[0]
        state["state2"] = torch.zeros_like(param, dtype=torch.uint8)
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
