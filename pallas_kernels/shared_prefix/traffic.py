"""KV bytes one decode step reads, with and without a shared prefix (the numbers of MEMORY_TRAFFIC.md).

Attention reads every filled K and V slot once per step and layer (each row's new tokens, a decode token
or a whole verify block, share one read: the tile layout of the kernels). Without sharing, each of the
rows reads its own copy of the prefix; with sharing, each group's prefix is read once (the kernel fetches
each prefix tile once per group and KV head, see tests/pallas_kernels/test_shared_prefix_attention.py),
and each row reads only its own part.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepTraffic:
    """Bytes of K and V one decode step reads over all layers."""

    unshared: int
    shared: int
    prefix_unshared: int
    prefix_shared: int


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V of one token over all layers: layers x 2 x KV heads x head_dim x bytes per element."""
    return num_layers * 2 * num_kv_heads * head_dim * itemsize


def decode_step_traffic(per_token: int, rows: int, prefix: int, own: int, groups: int = 1) -> StepTraffic:
    """KV bytes read by one decode step of `rows` rows in `groups` equal groups, each group sharing a
    `prefix`-token prefix, each row holding `own` tokens of its own (rest of prompt + generated)."""
    prefix_unshared = rows * prefix * per_token
    prefix_shared = groups * prefix * per_token
    own_bytes = rows * own * per_token
    return StepTraffic(prefix_unshared + own_bytes, prefix_shared + own_bytes, prefix_unshared, prefix_shared)
