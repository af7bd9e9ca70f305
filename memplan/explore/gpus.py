"""One configuration on several cards: which of them it fits, and the cheapest that it fits.

Each card is its own estimate: its compute capability picks the CUDA kernels (attention backend,
cuBLAS workspace size, TF32 convolutions) and so the trace, and its usable memory (memory less the
CUDA context and, on a data-parallel rank, NCCL's buffers) is the budget, with the largest batch
size that fits. Prices come from memplan.prices, with their source and date; a card without a
listed price is never the cheapest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from memplan.errors import SettingsError
from memplan.estimator.estimate import Progress, run_estimate
from memplan.estimator.result import EstimateResult
from memplan.gpus import gpu_named
from memplan.models.source import ModelSpec
from memplan.prices import ListPrice, list_price
from memplan.settings import TrainingSettings


@dataclass(frozen=True)
class GpuOption:
    gpu: str
    estimate: EstimateResult  # with the card's usable memory as budget: fits, max_batch_size
    price: ListPrice | None

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "gpu": self.gpu,
            "budget_bytes": e.budget_bytes,
            "peak_bytes": e.peak_bytes,
            "reserved_peak_bytes": e.reserved_peak_bytes,
            "smallest_device_bytes": e.smallest_device_bytes,
            "fits": e.fits,
            "max_batch_size": e.max_batch_size,
            "usd_per_hour": self.price.usd_per_hour if self.price else None,
            "price_provider": self.price.provider if self.price else None,
            "price_source": self.price.source_url if self.price else None,
            "price_checked": self.price.checked if self.price else None,
        }


@dataclass(frozen=True)
class GpuChoiceResult:
    model: str
    settings: TrainingSettings  # as given, without a card
    options: tuple[GpuOption, ...]  # in the order the cards were named
    seconds: float

    @property
    def fitting(self) -> tuple[GpuOption, ...]:
        return tuple(option for option in self.options if option.estimate.fits)

    @property
    def cheapest(self) -> GpuOption | None:
        """The fitting card with the lowest listed price per hour (None: no fitting card has a price)."""
        priced = [option for option in self.fitting if option.price is not None]
        return min(priced, key=lambda option: option.price.usd_per_hour if option.price else 0.0, default=None)

    def to_dict(self) -> dict[str, Any]:
        cheapest = self.cheapest
        return {
            "model": self.model,
            "settings": self.settings.to_dict(),
            "options": [option.to_dict() for option in self.options],
            "fitting": [option.gpu for option in self.fitting],
            "cheapest": cheapest.gpu if cheapest is not None else None,
            "seconds": round(self.seconds, 3),
        }


def card_names(gpus: list[str] | tuple[str, ...]) -> list[str]:
    """memplan's names of the cards, each once, in the order given (aliases such as `a100` resolved)."""
    if not gpus:
        raise SettingsError("name at least one GPU to choose among (e.g. T4,L4,A100-40GB)")
    names: list[str] = []
    for gpu in gpus:
        if not isinstance(gpu, str) or not gpu.strip():
            raise SettingsError(f"each GPU must be a name such as 'T4' or 'A100-40GB'; got {gpu!r}")
        name = gpu_named(gpu.strip()).name
        if name in names:
            raise SettingsError(f"{name} is named more than once; name each card once")
        names.append(name)
    return names


def run_gpu_choice(
    spec: ModelSpec, settings: TrainingSettings, gpus: list[str], progress: Progress | None = None
) -> GpuChoiceResult:
    """Estimate `settings` on each card, its usable memory the budget."""
    if settings.device != "cuda":
        raise SettingsError("choosing a GPU needs the cuda target; leave out --device cpu")
    started = time.perf_counter()
    names = card_names(gpus)
    report = progress or (lambda message: None)
    options = []
    labels = [f"[{number}/{len(names)}] {name}" for number, name in enumerate(names, start=1)]
    for name, label in zip(names, labels, strict=True):
        on_card = settings.replace(gpu=name)
        fraction = on_card.allocator_config.per_process_memory_fraction
        budget = gpu_named(name).budget_bytes(on_card.outside_allocator_bytes, fraction)
        estimate = run_estimate(
            spec,
            on_card,
            budget_bytes=budget,
            progress=lambda message, label=label: report(f"{label}: {message}"),
        )
        options.append(GpuOption(name, estimate, list_price(name)))
    return GpuChoiceResult(spec.name, settings, tuple(options), time.perf_counter() - started)
