"""Human units for FLOPs and seconds (bytes: memplan.sizes.format_bytes)."""

from __future__ import annotations


def format_flops(value: int) -> str:
    return f"{value / 1e12:,.2f} TFLOP" if value >= 1e11 else f"{value / 1e9:,.2f} GFLOP"


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if abs(seconds) >= 1e-3 else f"{seconds * 1e6:,.0f} µs"
