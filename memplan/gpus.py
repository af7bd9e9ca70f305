"""GPUs by name: memory capacity and compute capability (which picks CUDA kernels, e.g. SDPA's).

`total_bytes` is the memory.total nvidia-smi reports (MiB). The H100 and H200 figures were read
on this project's lent machines (/work/.library/device/KINDS.md: "NVIDIA H100 80GB HBM3 with
81559 MiB", "NVIDIA H200 with 143771 MiB"); the others are the figures nvidia-smi is publicly
reported to show for those cards and are not measured by memplan.

`throughput` holds the datasheet peaks the roofline time estimate uses (memplan.estimator.cuda.
roofline): dense (no structured sparsity) FLOP/s per math mode and the memory bandwidth, from
NVIDIA's datasheets and architecture whitepapers for each card (H100/H200 SXM, H100 NVL, A100
SXM, L40S, RTX A6000, L4, A10, Ada and Ampere GeForce whitepapers for the RTX 4090 / 3090 with
FP32 accumulation, T4, V100 SXM2). None of them is measured by memplan. A10G is AWS's variant
of the A10, whose own peaks are unpublished; the A10's are used.

`usable_bytes` subtracts the CUDA context, which nvidia-smi counts but torch.cuda never sees.
CONTEXT_BYTES is measured on one machine: the lent H100 (driver 580.159.04, torch 2.11.0+cu130,
CUDA 13.0, cuDNN 9.19, lazy module loading), as cudaMemGetInfo's total - free less
max_memory_reserved after a training step, over the 27 configurations of the main suite: 750.8 to
770.8 MiB, median 766.8 MiB (docs/validation/h100/measured-main.json). Of that, the context alone
(one tensor allocated) was 526.8 MiB (docs/validation/h100/environment.json); the rest is the
kernels cuBLAS, cuDNN and torch load lazily on first use (fp32 transformers 751 MiB, cuDNN
attention 767, cuDNN convolutions 769-771). Other GPUs and CUDA versions are not measured: CUDA
11 without lazy loading was reported at 1.3-1.4 GiB. Give yours with --cuda-context.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from memplan.errors import SettingsError

MiB = 1 << 20
CONTEXT_BYTES = 767 * MiB  # the main suite's median on the lent H100, rounded up to whole MiB


TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Throughput:
    """Datasheet peaks: dense FLOP/s by math mode, and bytes/s of device memory."""

    fp32_flops: float  # CUDA cores
    tf32_flops: float | None  # tensor cores; None where there are none for TF32 (Volta, Turing)
    fp16_flops: float  # tensor cores, FP32 accumulation
    bf16_flops: float | None  # None: no BF16 tensor cores (bf16 math then runs at the fp32 rate)
    memory_bytes_per_s: float


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int
    compute_capability: tuple[int, int]
    throughput: Throughput
    measured: bool = False  # total_bytes read on a lent machine, not taken from public reports

    @property
    def multiprocessors(self) -> int:
        """Streaming multiprocessors (cudaDeviceProp.multiProcessorCount); see MULTIPROCESSORS."""
        return MULTIPROCESSORS[self.name]

    @property
    def usable_bytes(self) -> int:
        return self.budget_bytes(CONTEXT_BYTES)

    def budget_bytes(self, outside_allocator_bytes: int, memory_fraction: float | None = None) -> int:
        """What the card leaves torch's allocator, with `outside_allocator_bytes` (the CUDA context, NCCL's
        communicator: TrainingSettings.outside_allocator_bytes) taken off; one line where that leaves nothing.
        `memory_fraction` (PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction) caps the allocator at that
        share of the card's memory, as torch's allowed_memory_maximum does (CUDACachingAllocator.cpp)."""
        budget = self.total_bytes - outside_allocator_bytes
        if memory_fraction is not None:
            budget = min(budget, int(memory_fraction * self.total_bytes))
            if int(memory_fraction * self.total_bytes) <= 0:
                raise SettingsError(
                    f"per_process_memory_fraction:{memory_fraction:g} leaves torch's allocator nothing of the "
                    f"{self.name}: give a fraction above 0 in --cuda-alloc-conf (or PYTORCH_CUDA_ALLOC_CONF, "
                    "PYTORCH_ALLOC_CONF)"
                )
        if budget <= 0:
            from memplan.sizes import format_bytes

            raise SettingsError(
                f"the {self.name} has {format_bytes(self.total_bytes)}, and the CUDA context with what else is held "
                f"outside torch's allocator takes {format_bytes(outside_allocator_bytes)}: nothing is left for the "
                "step; give a smaller --cuda-context (or --nccl-memory)"
            )
        return budget

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "total_bytes": self.total_bytes,
            "usable_bytes": self.usable_bytes,
            "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
            "throughput": dataclasses.asdict(self.throughput),
        }


GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu(
            "H200",
            143771 * MiB,
            (9, 0),
            Throughput(67 * TERA, 494.7 * TERA, 989.4 * TERA, 989.4 * TERA, 4800 * GIGA),
            measured=True,
        ),
        Gpu(
            "H100-80GB",
            81559 * MiB,
            (9, 0),
            Throughput(67 * TERA, 494.7 * TERA, 989.4 * TERA, 989.4 * TERA, 3350 * GIGA),
            measured=True,
        ),
        Gpu(
            "H100-94GB",
            95830 * MiB,
            (9, 0),
            Throughput(60 * TERA, 417.5 * TERA, 835.5 * TERA, 835.5 * TERA, 3900 * GIGA),
        ),
        Gpu("A100-80GB", 81920 * MiB, (8, 0), Throughput(19.5 * TERA, 156 * TERA, 312 * TERA, 312 * TERA, 2039 * GIGA)),
        Gpu("A100-40GB", 40960 * MiB, (8, 0), Throughput(19.5 * TERA, 156 * TERA, 312 * TERA, 312 * TERA, 1555 * GIGA)),
        Gpu("L40S", 46068 * MiB, (8, 9), Throughput(91.6 * TERA, 183 * TERA, 362 * TERA, 362 * TERA, 864 * GIGA)),
        Gpu("A6000", 49140 * MiB, (8, 6), Throughput(38.7 * TERA, 77.4 * TERA, 154.8 * TERA, 154.8 * TERA, 768 * GIGA)),
        Gpu("L4", 23034 * MiB, (8, 9), Throughput(30.3 * TERA, 60 * TERA, 121 * TERA, 121 * TERA, 300 * GIGA)),
        Gpu("A10G", 23028 * MiB, (8, 6), Throughput(31.2 * TERA, 62.5 * TERA, 125 * TERA, 125 * TERA, 600 * GIGA)),
        Gpu(
            "RTX-4090",
            24564 * MiB,
            (8, 9),
            Throughput(82.6 * TERA, 82.6 * TERA, 165.2 * TERA, 165.2 * TERA, 1008 * GIGA),
        ),
        Gpu("RTX-3090", 24576 * MiB, (8, 6), Throughput(35.6 * TERA, 35.6 * TERA, 71 * TERA, 71 * TERA, 936 * GIGA)),
        Gpu("T4", 15360 * MiB, (7, 5), Throughput(8.1 * TERA, None, 65 * TERA, None, 320 * GIGA)),
        Gpu("V100-32GB", 32768 * MiB, (7, 0), Throughput(15.7 * TERA, None, 125 * TERA, None, 900 * GIGA)),
        Gpu("V100-16GB", 16160 * MiB, (7, 0), Throughput(15.7 * TERA, None, 125 * TERA, None, 900 * GIGA)),
    )
}
# Streaming multiprocessors per card, from NVIDIA's datasheets and architecture whitepapers (H100
# SXM5 and NVL 132, H200 132, A100 108, L40S 142, RTX A6000 84, L4 58, RTX 4090 128, RTX 3090 82,
# T4 40, V100 80); A10G, AWS's A10 variant, reports 80 (the A10 has 72). Kernels that split work
# across the whole GPU size buffers by it (flash attention's deterministic backward).
MULTIPROCESSORS = {
    "H200": 132,
    "H100-80GB": 132,
    "H100-94GB": 132,
    "A100-80GB": 108,
    "A100-40GB": 108,
    "L40S": 142,
    "A6000": 84,
    "L4": 58,
    "A10G": 80,
    "RTX-4090": 128,
    "RTX-3090": 82,
    "T4": 40,
    "V100-32GB": 80,
    "V100-16GB": 80,
}
# What memplan assumes about kernels when no --gpu is named: the generation of an H100.
DEFAULT_GPU = "H100-80GB"


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_ALIASES = {_key(name): name for name in GPUS}
_ALIASES.update({_key("H100"): "H100-80GB", _key("A100"): "A100-80GB", _key("V100"): "V100-16GB"})


def gpu_named(name: str) -> Gpu:
    """`H100-80GB`, `h100`, `A100 40GB`, `rtx4090`: case, spaces and dashes don't matter."""
    found = _ALIASES.get(_key(name))
    if found is None and "," in name and all(_key(part) in _ALIASES for part in name.split(",")):
        raise SettingsError(
            f"--gpu {name!r} names several cards, and this takes one: `memplan estimate` compares cards given as "
            "a list (which_gpu from Python)"
        )
    if found is None:
        raise SettingsError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[found]
