"""Print what CPU kernels take from the allocator inside one op, beside their outputs: the scratch memplan's cpu
target does not model (README, "Accuracy"). Each op runs under torch's profiler; the allocator's peak during it,
less the bytes of what it returns, is the scratch. With oneDNN off too, as the tests that measure by allocator
events run (tests/hand_measure.py).

Usage: python benchmarks/cpu_kernel_scratch.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def scratch_bytes(op: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """(the allocator's peak during `op`, the bytes of its output)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        out = op()
    held = peak = 0
    events = sorted(profiler.profiler.kineto_results.events(), key=lambda event: event.start_ns())
    for event in events:
        if event.name() == "[memory]":
            held += event.nbytes()
            peak = max(peak, held)
    return peak, out.untyped_storage().nbytes()


def _matmul(dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    a, b = torch.randn(64, 64).to(dtype), torch.randn(64, 256).to(dtype)
    return lambda: a @ b


def _conv(dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    x, w = torch.randn(2, 16, 32, 32).to(dtype), torch.randn(16, 16, 3, 3).to(dtype)
    return lambda: torch.nn.functional.conv2d(x, w, padding=1)


def main() -> None:
    torch.manual_seed(0)
    cases = {"matmul [64, 64] @ [64, 256]": _matmul, "conv2d 3x3, 16 channels, [2, 16, 32, 32]": _conv}
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| op | dtype | oneDNN | allocator peak (B) | output (B) | scratch (B) |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for name, make in cases.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for enabled in (True, False):
                with torch.backends.mkldnn.flags(enabled=enabled):
                    peak, output = scratch_bytes(make(dtype))
                flag = "on" if enabled else "off"
                print(f"| {name} | {str(dtype)[6:]} | {flag} | {peak:,} | {output:,} | {peak - output:,} |")


if __name__ == "__main__":
    main()
