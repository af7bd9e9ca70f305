"""GPUs by name: memory capacity and compute capability (which picks CUDA kernels, e.g. SDPA's).

`total_bytes` is the memory.total nvidia-smi reports (MiB). The H100 and H200 figures were read
on this project's lent machines (/work/.library/device/KINDS.md: "NVIDIA H100 80GB HBM3 with
81559 MiB", "NVIDIA H200 with 143771 MiB"); the others are the figures nvidia-smi is publicly
reported to show for those cards and are not measured by memplan.

`usable_bytes` subtracts the CUDA context, which nvidia-smi counts but torch.cuda never sees.
CONTEXT_BYTES is an estimate, not a measurement: the CUDA 12/13 context with lazy module loading
plus the kernels torch loads for a training step is typically reported at 300-600 MiB; memplan
assumes 512 MiB until `memplan validate` on a GPU measures it (device_peak_bytes - reserved).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memplan.errors import SettingsError

MiB = 1 << 20
CONTEXT_BYTES = 512 * MiB


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int
    compute_capability: tuple[int, int]
    measured: bool = False  # total_bytes read on a lent machine, not taken from public reports

    @property
    def usable_bytes(self) -> int:
        return self.total_bytes - CONTEXT_BYTES

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "total_bytes": self.total_bytes,
            "usable_bytes": self.usable_bytes,
            "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
        }


GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("H200", 143771 * MiB, (9, 0), measured=True),
        Gpu("H100-80GB", 81559 * MiB, (9, 0), measured=True),
        Gpu("H100-94GB", 95830 * MiB, (9, 0)),
        Gpu("A100-80GB", 81920 * MiB, (8, 0)),
        Gpu("A100-40GB", 40960 * MiB, (8, 0)),
        Gpu("L40S", 46068 * MiB, (8, 9)),
        Gpu("A6000", 49140 * MiB, (8, 6)),
        Gpu("L4", 23034 * MiB, (8, 9)),
        Gpu("A10G", 23028 * MiB, (8, 6)),
        Gpu("RTX-4090", 24564 * MiB, (8, 9)),
        Gpu("RTX-3090", 24576 * MiB, (8, 6)),
        Gpu("T4", 15360 * MiB, (7, 5)),
        Gpu("V100-32GB", 32768 * MiB, (7, 0)),
        Gpu("V100-16GB", 16160 * MiB, (7, 0)),
    )
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
    if found is None:
        raise SettingsError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[found]
