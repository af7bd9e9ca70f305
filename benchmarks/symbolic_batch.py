"""Would one trace with a symbolic batch size replace the estimate's two concrete traces? (issue 20)

Usage: python benchmarks/symbolic_batch.py [--batch 8] [--seq-len 1024] [--repeats 3]
GPT-2 (GPT2Config() defaults, 124M) forward with labels and backward under FakeTensorMode, timed at a
concrete batch size and with the batch dimension symbolic (a ShapeEnv, DimDynamic.DYNAMIC), with and
without routing aten.constant_pad_nd through torch._refs: the C++ kernel behind F.pad (transformers'
ForCausalLMLoss pads the labels) reads each size as an int, which fixes the batch to its example value.
Prints, per variant, the best time, the guards the ShapeEnv recorded and how many op outputs keep a
size in the batch symbol. The model is built once per variant, under its own mode.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._refs
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()


class OutputSizes(TorchDispatchMode):
    """Counts op outputs whose storage size keeps a free symbol; optionally decomposes constant_pad_nd."""

    def __init__(self, decompose_pad: bool) -> None:
        super().__init__()
        self.decompose_pad = decompose_pad
        self.symbolic = self.outputs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.decompose_pad and func is torch.ops.aten.constant_pad_nd.default:
            result = torch._refs.constant_pad_nd(*args, **(kwargs or {}))
        else:
            result = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                size = tensor.untyped_storage().nbytes()
                self.outputs += 1
                self.symbolic += isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols)
        return result


def step(batch: int, seq_len: int, symbolic: bool, decompose_pad: bool) -> tuple[float, list[str], OutputSizes]:
    shape_env = ShapeEnv() if symbolic else None
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    with mode:
        model = GPT2LMHeadModel(GPT2Config())
    dynamic = [DimDynamic.DYNAMIC, DimDynamic.STATIC]
    context = StatelessSymbolicContext(dynamic_sizes=dynamic) if symbolic else None
    ids = mode.from_tensor(torch.zeros(batch, seq_len, dtype=torch.long), symbolic_context=context)
    sizes = OutputSizes(decompose_pad)
    started = time.perf_counter()
    with mode, sizes:
        model(input_ids=ids, labels=ids).loss.backward()
    seconds = time.perf_counter() - started
    guards = sorted({str(guard.expr) for guard in shape_env.guards}) if shape_env is not None else []
    return seconds, guards, sizes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    print(f"torch {torch.__version__}; gpt2 forward+backward, batch {options.batch}, seq {options.seq_len}")
    for name, symbolic, decompose_pad in [
        ("concrete", False, False),
        ("symbolic batch", True, False),
        ("symbolic batch, pad decomposed", True, True),
    ]:
        runs = [step(options.batch, options.seq_len, symbolic, decompose_pad) for _ in range(options.repeats)]
        seconds = min(run[0] for run in runs)
        _, guards, sizes = runs[-1]
        print(
            f"{name:32s} best {seconds:.2f} s; guards {guards or 'none'}; "
            f"{sizes.symbolic:,} of {sizes.outputs:,} op outputs sized in the batch symbol"
        )


if __name__ == "__main__":
    main()
