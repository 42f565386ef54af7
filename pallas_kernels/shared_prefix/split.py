"""FlashDecoding-style split of a long shared prefix over its length, for the jnp level 1.

Level 1 (`chunked._prefix_dense`) is one product per (group, KV head) of that group's queries [X, H] with
its prefix [L, H]. With few groups and KV heads and few queries (a small batch decoding), those products are
fewer than the cores and each is a thin matrix-vector product: most cores idle while one walks the whole
prefix. Splitting the prefix into n parts gives n x more independent products, each over L / n slots, whose
partial softmax states (max, denominator, numerator) merge by log-sum-exp (`pallas.combine_tiles`, the merge
the Pallas prefix kernel uses for its tiles).

Not chosen automatically: in jnp the n parts become one batched product for XLA, and no gain showed. On
this 2-core machine (loaded, load average 11) one group and KV head with 4 queries over a 16,384-slot
prefix took 1.26 ms unsplit, 1.68 ms in 2 parts and 1.30 ms in 4. `shared_prefix_attention` takes
`prefix_splits` for a host where a measurement says otherwise.

Glossary: G groups, K kv heads, X queries of one (group, kv head), L prefix slots, H head_dim, n splits.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.shared_prefix.pallas import combine_tiles


def split_prefix_state(prefix_state, grouped, prefix_k, prefix_v, prefix_len, splits: int):
    """Level 1 over `splits` parts of every prefix, merged by log-sum-exp.

    Args:
      prefix_state: the unsplit level 1, (grouped [G, K, X, H], prefix_k, prefix_v [G, K, L, H],
        prefix_len [G]) -> (max, denominator [G, K, X], numerator [G, K, X, H]).
      grouped: [G, K, X, H] fp32 scaled queries of each (group, kv head).
      prefix_k, prefix_v: [G, K, L, H] the prefixes.
      prefix_len: [G] int32 valid slots per prefix.
      splits: n, dividing L.

    Returns:
      What prefix_state returns, equal up to rounding.
    """
    g, kv, x, h = grouped.shape
    slots = prefix_k.shape[2]
    part = slots // splits

    def parts(a):  # [G, K, L, H] -> [G * n, K, L / n, H]
        return a.reshape(g, kv, splits, part, h).transpose(0, 2, 1, 3, 4).reshape(g * splits, kv, part, h)

    starts = jnp.arange(splits, dtype=jnp.int32) * part  # [n]
    part_len = jnp.clip(prefix_len.astype(jnp.int32)[:, None] - starts[None, :], 0, part)  # [G, n]
    part_len = part_len.reshape(-1)  # [G * n]
    queries = jnp.broadcast_to(grouped[:, None], (g, splits, kv, x, h)).reshape(g * splits, kv, x, h)
    m, denom, acc = prefix_state(queries, parts(prefix_k), parts(prefix_v), part_len)

    def tiles(a):  # [G * n, K, X, ...] -> [G, K, n, X, ...]
        return jnp.moveaxis(a.reshape(g, splits, *a.shape[1:]), 1, 2)

    return combine_tiles(tiles(m), tiles(denom), tiles(acc))
