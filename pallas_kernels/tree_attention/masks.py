"""Compact descriptions of the new-token mask for the kernels, and their per-tile plans.

The kernels never read a dense [rows, keys] int32 mask. The mask of the new tokens comes in one of two forms:
- causal by index (`tree_mask=None`: prompts and chains): packed row r (token r // G) sees new key u iff
  u <= r // G, i.e. u * G <= r, computed in the kernel from iotas;
- bit words (any [B, T, T] bool mask: trees, draft blocks): bit i of word [b, w, u] is "packed row
  w * word_rows + i sees new key u", one bit per (row, key) pair, 32 x smaller than an int32 mask. The TPU
  kernel broadcasts each word row over its rows (sublanes) and shifts, with no gather along lanes; the GPU
  kernel loads each row's word (a row gather) and shifts.

Either form also gets a plan per (row, query tile): the chunks of `chunk` new keys the tile sees at all,
[first, end), and a run of chunks every real row of the tile sees whole, [full_lo, full_hi), which the
kernels score without any mask. Chunks outside [first, end) are neither fetched nor computed: a causal
prefill tile stops at its diagonal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PLAN_FIELDS = 4  # first, end, full_lo, full_hi


def word_rows(block_q: int, rows_pad: int) -> int:
    """Packed rows per bit word (dividing block_q): 32, or fewer so that a tile's words stay a whole number
    of 8-row (sublane) groups when the rows split into several tiles (a single tile may hold any count)."""
    if block_q == rows_pad:
        return int(np.gcd(block_q, 32))
    return int(np.gcd(block_q // 8, 32))


def mask_words(new_vis: jax.Array, group: int, rows_pad: int, u_pad: int, rows_per_word: int) -> jax.Array:
    """[B, T, U] bool visibility -> [B, rows_pad / rows_per_word, u_pad] int32 bit words in packed row order
    (row r = token r // group); bit i of word w is row w * rows_per_word + i. Pad rows and keys are 0.

    Built bit by bit from strided row gathers of the token mask, never as a [rows, keys] array (for a
    4096-token prompt on v5e XLA reports no temporaries for it)."""
    b, t, u = new_vis.shape
    vis = jnp.pad(new_vis, ((0, 0), (0, 0), (0, u_pad - u)))
    words = jnp.zeros((b, rows_pad // rows_per_word, u_pad), jnp.uint32)
    for i in range(rows_per_word):
        rows = jnp.arange(rows_pad // rows_per_word) * rows_per_word + i  # packed rows holding bit i
        bit = jnp.take(vis, jnp.minimum(rows // group, t - 1), axis=1) & (rows < t * group)[None, :, None]
        words = words | (bit.astype(jnp.uint32) << i)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def real_row_words(t: int, group: int, rows_pad: int, rows_per_word: int) -> np.ndarray:
    """[rows_pad / rows_per_word] int32: the bits of the real (not padding) rows of each word."""
    rows = np.arange(rows_pad).reshape(-1, rows_per_word)
    bits = (rows < t * group).astype(np.uint64) << np.arange(rows_per_word, dtype=np.uint64)
    return bits.sum(axis=1).astype(np.uint32).view(np.int32)


def expand_words(words: jax.Array, rows_per_word: int) -> jax.Array:
    """Inverse of `mask_words` for one tile: [rows / rows_per_word, keys] int32 -> [rows, keys] bool.

    Each word row is broadcast over its rows (a sublane broadcast) and the row's bit shifted down."""
    n_words, keys = words.shape
    pieces = [jnp.broadcast_to(words[i : i + 1], (rows_per_word, keys)) for i in range(n_words)]
    spread = pieces[0] if n_words == 1 else jnp.concatenate(pieces, axis=0)  # [rows, keys]
    bit = jax.lax.broadcasted_iota(jnp.int32, spread.shape, 0) % rows_per_word
    return (jax.lax.shift_right_logical(spread, bit) & 1) != 0


def words_plan(words: jax.Array, real_words: np.ndarray, block_q: int, rows_per_word: int, chunk: int):
    """Bit words [B, W, U] (from `mask_words`) -> [B * QT * 4] int32 (first, end, full_lo, full_hi) per
    (row, query tile): the chunks with any visible key, and the first run of chunks that every real row of
    the tile sees whole (pad keys are never visible, so a chunk holding one is never whole)."""
    b, w, u = words.shape
    per_tile = block_q // rows_per_word
    tiles = words.reshape(b, w // per_tile, per_tile, u // chunk, chunk)
    real = jnp.asarray(real_words).reshape(1, w // per_tile, per_tile, 1, 1)
    seen = (tiles != 0).any(axis=(2, 4))  # [B, QT, C]
    whole = (tiles == real).all(axis=(2, 4)) & (real != 0).any(axis=2)[..., 0]
    return _plan(seen, whole)


def causal_plan(batch: int, t: int, group: int, rows_pad: int, block_q: int, chunk: int, whole_ok: bool):
    """The plan of the causal-by-index mask, from shapes alone (`whole_ok=False` when a sliding window may
    hide keys inside a chunk, so that every visited chunk is masked)."""
    lo_row = np.arange(rows_pad // block_q) * block_q  # first packed row of each tile
    hi_row = np.minimum(lo_row + block_q, t * group) - 1  # last real row
    real = lo_row < t * group
    keys = np.arange(-(-max(t, 1) // chunk) * chunk).reshape(-1, chunk)  # [C, chunk]
    first_key, last_key = keys[:, 0], keys[:, -1]
    seen = real[:, None] & (first_key[None, :] <= (hi_row // group)[:, None])  # [QT, C]
    whole = real[:, None] & (last_key[None, :] <= (lo_row // group)[:, None]) & whole_ok
    return _plan(jnp.broadcast_to(seen, (batch, *seen.shape)), jnp.broadcast_to(whole, (batch, *whole.shape)))


def _plan(seen: jax.Array, whole: jax.Array) -> jax.Array:
    """[B, QT, C] bool (any key seen, all keys seen) -> [B * QT * 4] int32 plan."""
    num_chunks = seen.shape[-1]
    ids = jnp.arange(num_chunks, dtype=jnp.int32)
    end = jnp.max(jnp.where(seen, ids + 1, 0), axis=-1)
    first = jnp.minimum(jnp.min(jnp.where(seen, ids, num_chunks), axis=-1), end)
    full_lo = jnp.minimum(jnp.min(jnp.where(whole, ids, num_chunks), axis=-1), end)
    # The run of whole chunks from full_lo: up to the first chunk after it that is not whole.
    after = (ids >= full_lo[..., None]) & ~whole
    full_hi = jnp.minimum(jnp.min(jnp.where(after, ids, num_chunks), axis=-1), end)
    plan = jnp.stack([first, end, full_lo, jnp.maximum(full_hi, full_lo)], axis=-1)
    return plan.astype(jnp.int32).reshape(-1)
