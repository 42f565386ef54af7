"""Published per-chip figures for the roofline of a compiled plan: memory, HBM bandwidth, dense bf16 FLOP/s.

Datasheet values (Google Cloud TPU system architecture pages; NVIDIA H100 SXM / A100 SXM 80GB datasheets).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip as the roofline sees it.

    Attributes:
      name: what it is.
      memory_bytes: HBM per chip.
      bandwidth: HBM bytes/s.
      bf16_flops: dense bf16 FLOP/s.
    """

    name: str
    memory_bytes: int
    bandwidth: float
    bf16_flops: float


CHIPS = {
    "v5e": Chip("TPU v5e", 16 * 2**30, 819e9, 197e12),
    "v5p": Chip("TPU v5p", 95 * 2**30, 2765e9, 459e12),
    "v6e": Chip("TPU v6e", 32 * 2**30, 1640e9, 918e12),
    "h100": Chip("H100 SXM", 80 * 2**30, 3.35e12, 989e12),
    "a100": Chip("A100 SXM 80GB", 80 * 2**30, 2.039e12, 312e12),
}


def chip_of(platform: str, topology: str | None, card: str) -> Chip:
    """The chip of a TPU topology name ("v5e:2x4" -> v5e) or of a GPU card name."""
    key = (topology or "").split(":")[0] if platform == "tpu" else card
    if key not in CHIPS:
        raise ValueError(f"no figures for chip {key!r}; known: {', '.join(CHIPS)}")
    return CHIPS[key]
