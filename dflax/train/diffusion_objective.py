"""The masked-token objective of the adapted diffusion drafter (dflax.diffusion.adapted_drafter).

For a sequence of S tokens, M windows start at random anchors a_m inside the response (the anchors of
`dflax.train.objective.sample_anchors`). Window m is the block [token a_m | K slots] at positions
a_m .. a_m + K whose slots hold tokens a_m + 1 .. a_m + K, some replaced by the mask: all of them in a
fraction `all_masked_frac` of the windows (how DiffuSpec drafts: one refinement step from an all-masked
window), otherwise each slot masked with a probability drawn uniformly per window (the later refinement
steps). The loss is the cross-entropy of the masked slots only, slot k weighted exp(-(k - 1) / gamma),
with Dream's shift: block position k - 1 predicts slot k.

All windows of a sequence run in ONE forward, as DFlash's anchors do (`dflax.train.objective`): the
drafter's layers run causally over the whole sequence once (its per-layer K/V are the context of every
window), then every block attends to the context strictly before its anchor and to itself, never another
block (`dflax.models.block_attention`). This is the decoding forward's math (`observe` the prefix, then
`window_logits`), which the tests hold it equal to, window by window.

Glossary: N sequences, S padded length, M windows per sequence, R = N * M rows, K window slots, D width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from dflax.diffusion.adapted_drafter import AdaptedDrafter, AdaptedLayers
from dflax.models.cache import KVCache
from dflax.train import objective


@struct.dataclass
class Windows:
    """The training windows of a batch, one row per anchor (row r belongs to sequence r // M).

    Attributes:
      anchors: [R] int32 anchor positions a_m (the last committed token; 0 for unused rows).
      last: [R] int32 the anchor tokens.
      labels: [R, K] int32 tokens a_m + 1 .. a_m + K (0 where invalid).
      inputs: [R, K] int32 the slots as the drafter sees them: the label or the mask id.
      scored: [R, K] bool, the slot is masked and inside its sequence (it carries loss).
      valid: [R, K] bool, the slot lies inside its sequence.
    """

    anchors: jax.Array
    last: jax.Array
    labels: jax.Array
    inputs: jax.Array
    scored: jax.Array
    valid: jax.Array


def make_windows(
    key: jax.Array,
    tokens: jax.Array,
    prompt_lens: jax.Array,
    lengths: jax.Array,
    num_windows: int,
    window: int,
    mask_token_id: int,
    all_masked_frac: float,
) -> Windows:
    """Samples M anchored windows per sequence and masks their slots.

    Args:
      key: PRNG key.
      tokens: [N, S] int32 padded sequences.
      prompt_lens: [N] int32.
      lengths: [N] int32 real lengths (0 = an unused row).
      num_windows: M.
      window: K.
      mask_token_id: the mask id.
      all_masked_frac: the fraction of windows masked entirely (1.0: all of them, as in validation).

    Returns:
      Windows with R = N * M rows.
    """
    anchor_key, whole_key, rate_key, slot_key = jax.random.split(key, 4)
    blocks = objective.make_blocks(anchor_key, tokens, prompt_lens, lengths, num_windows, window)
    rows = blocks.anchors.shape[0]
    whole = jax.random.uniform(whole_key, (rows, 1)) < all_masked_frac  # [R, 1]
    rate = 1.0 - jax.random.uniform(rate_key, (rows, 1))  # [R, 1] in (0, 1]
    masked = whole | (jax.random.uniform(slot_key, (rows, window)) < rate)  # [R, K]
    inputs = jnp.where(masked | ~blocks.valid, mask_token_id, blocks.labels)
    return Windows(blocks.anchors, blocks.tokens, blocks.labels, inputs, masked & blocks.valid, blocks.valid)


def context_kv(drafter: AdaptedDrafter, params, tokens: jax.Array, lengths: jax.Array):
    """The drafter's per-layer K/V of whole sequences tokens [N, S] (causal, keys past lengths [N] unseen):
    (keys, values), one [N, S, K, H] array per layer each."""
    n, s = tokens.shape
    module = drafter.module
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (n, s))
    mask = jnp.tril(jnp.ones((s, s), jnp.bool_))[None] & (
        jnp.arange(s)[None, None, :] < lengths[:, None, None]
    )
    cache = KVCache.init(module.config.layers, n, s, module.dtype)
    x = module.apply(params["drafter"], params["embedding"], tokens, method=AdaptedLayers.embed)  # [N, S, D]
    _, cache = module.apply(
        params["drafter"], x, positions, cache, mask, write_cache=True, empty_cache=True, causal=True
    )
    # The cache is head-major [N, K, S, H]; the anchored blocks read [N, S, K, H].
    return tuple(jnp.swapaxes(x, 1, 2) for x in cache.k), tuple(jnp.swapaxes(x, 1, 2) for x in cache.v)


def window_hidden(
    drafter: AdaptedDrafter, params, tokens, lengths, windows: Windows, chunk: int
) -> jax.Array:
    """Hidden states [R, K + 1, D] of every window's block [last | inputs], all of a sequence's windows in
    one forward; block position k - 1 predicts slot k."""
    num_seqs = tokens.shape[0]
    rows, k = windows.inputs.shape
    per_seq = rows // num_seqs
    ks, vs = context_kv(drafter, params, tokens, lengths)
    block = jnp.concatenate([windows.last[:, None], windows.inputs], axis=1)  # [R, K + 1]
    positions = windows.anchors[:, None] + jnp.arange(k + 1, dtype=jnp.int32)  # [R, K + 1]
    module = drafter.module
    x = module.apply(params["drafter"], params["embedding"], block, method=AdaptedLayers.embed)  # [R, K+1, D]
    hidden = module.apply(
        params["drafter"],
        x.reshape(num_seqs, per_seq, k + 1, -1),
        positions.reshape(num_seqs, per_seq, k + 1),
        ks,
        vs,
        windows.anchors.reshape(num_seqs, per_seq),
        chunk,
        method=AdaptedLayers.anchored_blocks,
    )  # [N, M, K + 1, D]
    return hidden.reshape(rows, k + 1, -1)


def diffusion_loss(
    drafter: AdaptedDrafter,
    params,
    tokens: jax.Array,
    lengths: jax.Array,
    windows: Windows,
    weights: jax.Array,
    chunk_rows: int,
    attention_chunk: int,
) -> tuple[jax.Array, objective.BlockStats]:
    """The weighted masked-slot cross-entropy of a batch.

    Args:
      drafter: the adapted drafter.
      params: {"drafter": ... (differentiated), "embedding", "readout" (the target's, frozen)}.
      tokens: [N, S] int32 sequences; lengths [N] their real lengths.
      windows: the batch's windows (R = N * M rows).
      weights: [K] slot weights.
      chunk_rows: LM-head rows per chunk; attention_chunk: blocks per attention chunk.

    Returns:
      (loss = sum w_k * ce * scored / sum w_k * scored, BlockStats over the scored slots: top-1 accuracy
      per slot; accepted/reached are greedy acceptance where the windows are all masked).
    """
    params = {**params, "embedding": jax.lax.stop_gradient(params["embedding"])}
    params["readout"] = jax.lax.stop_gradient(params["readout"])
    hidden = window_hidden(drafter, params, tokens, lengths, windows, attention_chunk)  # [R, K + 1, D]
    # token_scores reads positions 1..K against labels 1..K: put block position k - 1 at k (the shift).
    shifted = jnp.roll(hidden, 1, axis=1)  # [R, K + 1, D]
    readout = functools.partial(drafter.readout, params)
    ce, rank = objective.token_scores(readout, shifted, windows.labels, chunk_rows)[:2]  # [R, K] each
    w = weights[None, :] * windows.scored
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-9)
    return loss, objective.block_stats(rank, windows.scored)
