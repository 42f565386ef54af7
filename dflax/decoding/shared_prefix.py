"""Prompts that share a token prefix: the prefix prefilled and stored once per group of rows.

`share_groups` finds, on the host, groups of consecutive prompts with a long common token prefix (chat
prompts under one system message, one prompt repeated for several samples). `prefill_shared` runs each
group's prefix through the target once, keeps its K/V in the cache's `SharedPrefix` (one copy per group,
not per row), then prefills each row's own rest of the prompt on top of it; both passes can run their real
tokens packed back to back (`packed_prefix`, `packed_own`). Decoding then runs unchanged:
attention reads a group's prefix once for all its rows (pallas_kernels.shared_prefix), the rows' positions
start after their prefix (`KVCache.positions`), and drafters observe the whole prompt as before.

Glossary: G groups, R rows per group, L prefix slots, B rows, P own prompt slots, S own cache slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dflax.decoding.decode import DecodeState, Proposer, first_state
from dflax.decoding.sampling import SamplingParams
from dflax.models.cache import KVCache, SharedPrefix
from dflax.models.packing import Packing
from dflax.models.transformer import Transformer
from pallas_kernels.shared_prefix import GroupLayout

# Below this many common tokens a shared prefix saves less than its extra prefill costs.
MIN_SHARED_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class PrefixGroup:
    """Rows whose prompts start with the same `length` tokens (each keeps at least one token of its own)."""

    rows: list[int]
    length: int


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def share_groups(
    prompt_ids: Sequence[Sequence[int]], min_shared: int = MIN_SHARED_TOKENS
) -> list[PrefixGroup]:
    """Groups consecutive prompts greedily: a group grows while its prompts' common prefix stays at least
    `min_shared` tokens and at least half of what the group shared before (so the samples of one prompt
    form their own group rather than joining the next prompt's under a short common system message). A
    prefix stops one token before its shortest prompt ends (every row prefills its last prompt token
    itself, whose logits give its first new token). Rows that share with no neighbour form one group with
    an empty prefix.

    Returns:
      The groups (every row in exactly one), or [] when no two prompts share min_shared tokens.
    """
    shared, alone = [], []
    rows, length = [], 0

    def close():
        if len(rows) > 1:
            shared.append(PrefixGroup(list(rows), length))
        else:
            alone.extend(rows)

    for i, ids in enumerate(prompt_ids):
        joined = min(length, common_prefix_length(prompt_ids[rows[0]], ids), len(ids) - 1) if rows else 0
        if rows and joined >= min_shared and 2 * joined >= length:
            rows.append(i)
            length = joined
            continue
        close()
        rows, length = [i], len(ids) - 1
    close()
    if not shared:
        return []
    return shared + ([PrefixGroup(alone, 0)] if alone else [])


def prefill_shared(
    model: Transformer,
    params: dict,
    prefix_tokens: jax.Array,
    prefix_lens: jax.Array,
    layout: GroupLayout,
    row_offsets: jax.Array,
    own_tokens: jax.Array,
    own_lens: jax.Array,
    cache: KVCache,
    max_new: jax.Array,
    row_keys: jax.Array,
    eos_ids: jax.Array,
    sampling: SamplingParams,
    drafter_params: Any = None,
    *,
    max_tokens: int,
    proposer: Proposer | None = None,
    packed_prefix: int | None = None,
    packed_own: int | None = None,
) -> DecodeState:
    """`prefill` for rows whose prompts start with their group's shared prefix.

    Args:
      model, params: the target.
      prefix_tokens: [G, L] int32 each group's prefix, right-padded.
      prefix_lens: [G] int32 their lengths (0 for a group without one).
      layout: which rows belong to which group.
      row_offsets: [B] int32 each row's prefix length (prefix_lens of its group; 0 for padding rows).
      own_tokens: [B, P] int32 the rest of each prompt, right-padded.
      own_lens: [B] int32 its length (>= 1).
      cache: an empty cache of S >= P + max_tokens + max_draft + 1 own slots per row.
      max_new, row_keys, eos_ids, sampling, drafter_params, max_tokens, proposer: as in `prefill`.
      packed_prefix: static size >= sum(prefix_lens): run the prefixes' token-wise work on their real
        tokens packed back to back (see dflax.models.packing); None = all G x L slots.
      packed_own: static size >= sum(own_lens): the same for the rows' own prompt rests, which then also
        attend packed on the CPU path (pallas_kernels.shared_prefix.packed); None = all B x P slots.

    Returns:
      The initial decode state; its cache holds the shared prefixes and the rows' own prompt parts.
    """
    g, length = prefix_tokens.shape
    b, p = own_tokens.shape
    dtype = cache.k[0].dtype
    taps_wanted = proposer.tap_layers if proposer else ()

    # Each group's prefix once: [G, L] tokens at positions 0 .. L - 1.
    prefix_positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (g, length))
    prefix_cache = KVCache.init(model.config, g, length, dtype)
    prefix_packing = _packing(prefix_lens, length, packed_prefix)
    _, prefix_cache, prefix_taps = model.apply(
        params,
        prefix_tokens,
        prefix_positions,
        prefix_cache,
        None,  # causal by index
        taps_wanted,
        empty_cache=True,
        packing=prefix_packing,
    )
    if prefix_packing is not None:
        prefix_taps = tuple(prefix_packing.unpack(tap[0]) for tap in prefix_taps)  # [G, L, D] each
    shared = SharedPrefix(
        k=prefix_cache.k,  # [G, K, L, H] per layer
        v=prefix_cache.v,
        lengths=prefix_lens,
        layout=layout,
        row_offsets=row_offsets,
    )

    # Each row's own part on top of its group's prefix.
    positions = row_offsets[:, None] + jnp.arange(p, dtype=jnp.int32)  # [B, P]
    own_packing = _packing(own_lens, p, packed_own)
    hidden, cache, taps = model.apply(
        params, own_tokens, positions, cache.replace(shared=shared), None, taps_wanted, empty_cache=True,
        packing=own_packing,
    )  # fmt: skip
    if own_packing is None:
        last_hidden = jnp.take_along_axis(hidden, (own_lens - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    else:  # row r's last token is packed at sum(own_lens[:r + 1]) - 1
        last_hidden = hidden[0, jnp.cumsum(own_lens) - 1]  # [B, D]
        taps = tuple(own_packing.unpack(tap[0]) for tap in taps)  # [B, P, D] each

    drafter_state = None
    if proposer:  # the drafter keeps its own per-row context: the prefix, then the row's own part
        drafter_state = proposer.init_state(b, length + cache.max_len, cache.dtype)
        row_prefix = lambda x: x[layout.row_group]  # noqa: E731  [G, ...] -> [B, ...]
        drafter_state = proposer.observe(
            drafter_params, drafter_state, row_prefix(prefix_tokens), tuple(map(row_prefix, prefix_taps)),
            jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length)), row_offsets,
        )  # fmt: skip
        drafter_state = proposer.observe(drafter_params, drafter_state, own_tokens, taps, positions, own_lens)
    cache = cache.replace(lengths=own_lens.astype(jnp.int32))
    return first_state(
        model, params, last_hidden, cache, max_new, row_keys, eos_ids, sampling, drafter_state,
        max_tokens=max_tokens, proposer=proposer,
    )  # fmt: skip


def _packing(lens: jax.Array, length: int, size: int | None) -> Packing | None:
    """The packing of rows of lens [N] real tokens of a [N, length] layout into `size` slots (None: none)."""
    return None if size is None else Packing.of_lengths(lens, length, size)
