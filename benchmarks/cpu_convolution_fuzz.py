"""Random CPU convolutions (oneDNN off) run for real and predicted, op by op: what each forward and backward holds
beside its outputs by torch.profiler's memory events (tests/hand_measure.py held_beside_outputs) against
memplan.estimator.composite_kernels' rules. Prints every miss and the count.

Usage: python benchmarks/cpu_convolution_fuzz.py [SEED] [TRIALS] [DIMS]   (defaults 0, 60, 3; DIMS 1, 2 or 3)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memplan.estimator.composite_kernels import kernel_scratch_bytes  # noqa: E402
from tests.hand_measure import held_beside_outputs  # noqa: E402

CONVOLUTION, BACKWARD = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default
CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}


def main() -> None:
    seed, trials, dims = (int(arg) for arg in (sys.argv[1:] + ["0", "60", "3"][len(sys.argv) - 1 :])[:3])
    torch.set_num_threads(1)
    rng = random.Random(seed)
    missed = run = 0
    for _ in range(trials):
        transposed = rng.random() < 0.5
        groups = rng.choice([1, 1, 2, 4])
        in_channels, out_channels = groups * rng.choice([1, 2, 3]), groups * rng.choice([1, 2, 3])
        kernel, stride, padding = rng.choice([1, 2, 3]), rng.choice([1, 1, 2]), rng.choice([0, 1])
        dilation = rng.choice([1, 1, 2])
        output_padding = rng.choice([0, 1]) if transposed and stride > 1 else 0
        dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float64])
        input = torch.randn(rng.choice([1, 2, 3]), in_channels, *[rng.choice([5, 8])] * dims, dtype=dtype)
        if dims in CHANNELS_LAST and rng.random() < 0.3:
            input = input.contiguous(memory_format=CHANNELS_LAST[dims])
        per_group = out_channels // groups if transposed else in_channels // groups
        weight_shape = (in_channels if transposed else out_channels, per_group, *[kernel] * dims)
        weight = torch.randn(*weight_shape, dtype=dtype)
        bias = torch.randn(out_channels, dtype=dtype) if rng.random() < 0.6 else None
        geometry = ([stride] * dims, [padding] * dims, [dilation] * dims, transposed, [output_padding] * dims, groups)
        forward_args = (input, weight, bias, *geometry)
        try:
            with torch.backends.mkldnn.flags(enabled=False):
                output = CONVOLUTION(*forward_args)
                mask = [rng.random() < 0.7, True, bias is not None]
                bias_sizes = [out_channels] if bias is not None else None
                backward_args = (torch.randn_like(output), input, weight, bias_sizes, *geometry, mask)
                measured = tuple(held_beside_outputs(lambda a=a, op=op: op(*a)) for op, a in
                                 ((CONVOLUTION, forward_args), (BACKWARD, backward_args)))  # fmt: skip
                predicted = (
                    kernel_scratch_bytes(CONVOLUTION, forward_args, {}, "cpu"),
                    kernel_scratch_bytes(BACKWARD, backward_args, {}, "cpu"),
                )
        except RuntimeError:
            continue  # a configuration torch refuses (output padding past the stride and dilation, ...)
        run += 1
        if measured != predicted:
            missed += 1
            print(f"miss: {tuple(input.shape)} {weight_shape} {geometry} {dtype} mask {mask}: "
                  f"measured {measured}, predicted {predicted}", flush=True)  # fmt: skip
    print(f"{missed} of {run} configurations missed (seed {seed}, {dims}-D)")


if __name__ == "__main__":
    main()
