"""List prices of one GPU for an hour, on demand, where a public source gave one, with that source.

These answer "the cheapest card that fits" (`memplan estimate MODEL --gpu T4,L4,A100-40GB`). Prices
change often and differ between providers several times over; each entry names the provider, the
page that listed it and the date that page says its prices were checked, so the answer can be
re-checked. Cards without an entry are shown without a price, never given a guessed one.

Source: "Serverless GPU Pricing Matrix [2026 Developer Cheat Sheet]",
https://techbytes.app/posts/serverless-gpu-pricing-matrix-modal-replicate-lambda-2026/ — "Prices
verified on May 7, 2026 from official vendor pricing and documentation": Modal's per-second GPU
prices (as dollars per hour) and Lambda's on-demand 1-GPU instances. Where both listed a card, the
lower price is kept. Not listed there: H200, H100-94GB, A6000, A10G (Lambda's A10 is a different
card), RTX 4090/3090, V100.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE_URL = "https://techbytes.app/posts/serverless-gpu-pricing-matrix-modal-replicate-lambda-2026/"
SOURCE_DATE = "2026-05-07"


@dataclass(frozen=True)
class ListPrice:
    usd_per_hour: float
    provider: str
    source_url: str = SOURCE_URL
    checked: str = SOURCE_DATE  # the date the source says its prices were checked


# memplan.gpus names -> the cheapest on-demand price the source listed for one such GPU.
LIST_PRICES = {
    "T4": ListPrice(0.5904, "Modal"),
    "L4": ListPrice(0.7992, "Modal"),
    "L40S": ListPrice(1.9512, "Modal"),
    "A100-40GB": ListPrice(1.48, "Lambda"),
    "A100-80GB": ListPrice(2.4984, "Modal"),
    "H100-80GB": ListPrice(3.78, "Lambda"),  # 1x H100 SXM; its H100 PCIe was 2.86, a different card
}


def list_price(gpu_name: str) -> ListPrice | None:
    """The listed price of one hour of the card memplan calls `gpu_name`, or None where none was listed."""
    return LIST_PRICES.get(gpu_name)
