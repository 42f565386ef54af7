"""Two-level attention written out in float64 numpy: the oracle of `shared_prefix_attention`.

Each row b of group g = row_group[b] attends to the shared prefix prefix_k[g, :, :prefix_len[g]] (absolute
positions 0 .. prefix_len[g] - 1), then to its own cache slots [0, cache_len[b]) (positions prefix_len[g]
onwards), then to the new tokens its mask row allows, all in ONE softmax: the concatenated sequence, built
per row, exactly what per-row attention over an unshared cache holding prefix + own tokens computes.
"""

from __future__ import annotations

import numpy as np


def shared_prefix_reference(
    q, prefix_k, prefix_v, prefix_len, row_group, k_cache, v_cache, cache_len, k_new, v_new, new_mask,
    sm_scale,
) -> np.ndarray:  # fmt: skip
    """Per-row attention over [shared prefix; own cache; visible new tokens] in float64.

    Args:
      q: [B, T, N, H] queries.
      prefix_k, prefix_v: [G, K, L, H] shared prefixes (head-major).
      prefix_len: [G] valid prefix length per group.
      row_group: [B] each row's group.
      k_cache, v_cache: [B, K, S, H] each row's own cache (head-major); slots >= cache_len are never read.
      cache_len: [B].
      k_new, v_new: [B, T, K, H].
      new_mask: [B, T, T] bool, query i sees new token j.
      sm_scale: logit scale.

    Returns:
      [B, T, N, H] float64.
    """
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    q, k_cache, v_cache, k_new, v_new, prefix_k, prefix_v = map(
        as64, (q, k_cache, v_cache, k_new, v_new, prefix_k, prefix_v)
    )
    b, t, n, h = q.shape
    kv = k_cache.shape[1]
    out = np.zeros((b, t, n, h))
    for row in range(b):
        g, plen, clen = int(row_group[row]), int(prefix_len[row_group[row]]), int(cache_len[row])
        keys = np.concatenate(
            [prefix_k[g, :, :plen].transpose(1, 0, 2), k_cache[row, :, :clen].transpose(1, 0, 2), k_new[row]]
        )  # [L + C + T, K, H]
        values = np.concatenate(
            [prefix_v[g, :, :plen].transpose(1, 0, 2), v_cache[row, :, :clen].transpose(1, 0, 2), v_new[row]]
        )
        for i in range(t):
            visible = np.concatenate([np.ones(plen + clen, bool), np.asarray(new_mask[row, i], bool)])
            for head in range(n):
                k = head // (n // kv)
                scores = keys[visible, k] @ q[row, i, head] * sm_scale
                if scores.size == 0:
                    continue
                p = np.exp(scores - scores.max())
                out[row, i, head] = p @ values[visible, k] / p.sum()
    return out
