"""A projection, not a measurement: the speedup a measured tau implies on accelerators, from a roofline.

A forward over `tokens` tokens through `params` bf16 weights takes at least
max(weight bytes / memory bandwidth, 2 * params * tokens / peak FLOP/s). A plain step is one target forward
over one token per row; a speculative step that verifies B tokens per row (a block, or a tree's nodes and
root) is one drafter forward and one target forward over them and commits tau tokens on average. The
projected speedup is

    tau * t_target(rows) / (t_drafter(rows * B) + t_target(rows * B)).

KV-cache reads, kernel launches and host overhead are left out; for small targets, where a step lasts
microseconds, they dominate on a real chip, so read the figure as the ceiling the acceptance allows.
"""

from __future__ import annotations

import dataclasses

BF16_BYTES = 2


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Published peak figures of one chip: HBM bandwidth (bytes/s) and dense bf16 FLOP/s."""

    name: str
    memory_bytes_per_s: float
    bf16_flop_per_s: float


ACCELERATORS = {
    "tpu-v5e": Accelerator("TPU v5e", 819e9, 197e12),
    "h100": Accelerator("H100 SXM", 3.35e12, 989e12),
}

DESCRIPTION = (
    "projection from a bf16 roofline (weight bytes / HBM bandwidth vs FLOPs / peak; KV reads, kernel "
    "launches and host overhead left out) with the measured tau, not a measurement"
)


def forward_s(chip: Accelerator, params: int, tokens: int) -> float:
    """The roofline time of one forward of `tokens` tokens through `params` bf16 weights."""
    return max(params * BF16_BYTES / chip.memory_bytes_per_s, 2.0 * params * tokens / chip.bf16_flop_per_s)


def projected_speedup(
    chip: Accelerator, target_params: int, drafter_params: int, tau: float, verified: int, rows: int
) -> float:
    """The speedup over plain decoding that `tau` implies with `verified` tokens per row and step.

    Args:
      chip: the accelerator.
      target_params: weights a target forward reads (embedding gathers excluded).
      drafter_params: weights a drafter forward reads (its layers and the LM-head rows it scores).
      tau: measured mean tokens committed per speculative step.
      verified: tokens verified per row and step (the block size B, or a tree's nodes plus its root).
      rows: batch rows.
    """
    plain = forward_s(chip, target_params, rows)
    step = forward_s(chip, drafter_params, rows * verified) + forward_s(chip, target_params, rows * verified)
    return tau * plain / step
