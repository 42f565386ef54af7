"""Where a greedy output leaves the plain greedy output, and how close the target's choice was there.

At T=0 a lossless method repeats plain decoding token for token, except where the target's two best
logits are so close that computing them another way (a verify of several tokens instead of one-token
steps, a bf16 target) rounds the other way. `first_differences` records, for every output that differs,
the one-pass forward's logits of both tokens at the first differing position: a near-tie shows as a tiny
gap between the two best tokens; a wrong acceptance rule as a token far below the best one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflax.models.cache import KVCache
from dflax.models.transformer import Transformer
from dflax.target import Target

# Forwards are padded to a multiple of this many tokens: a bench compiles a few lengths, not one per prompt.
LENGTH_BUCKET = 64


@functools.partial(jax.jit, static_argnums=(0,))
def _logits(module: Transformer, params, ids: jax.Array, cache: KVCache) -> jax.Array:
    t = ids.shape[1]
    mask = jnp.tril(jnp.ones((1, t, t), jnp.bool_))
    hidden, _, _ = module.apply(params, ids, jnp.arange(t, dtype=jnp.int32)[None], cache, mask)
    return module.apply(params, hidden, method=Transformer.logits)[0]  # [T, V] float32


def sequence_logits(target: Target, ids: Sequence[int]) -> np.ndarray:
    """[T, V] float32 logits of every position of `ids`: one causal forward over an empty cache."""
    t = len(ids)
    padded = -(-t // LENGTH_BUCKET) * LENGTH_BUCKET  # causal: the padding after the sequence changes nothing
    tokens = jnp.asarray([list(ids) + [0] * (padded - t)], jnp.int32)
    cache = KVCache.init(target.config, 1, padded, target.dtype)
    return np.asarray(_logits(target.module, target.params, tokens, cache))[:t]


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length when one is a prefix of
    the other); None when they are equal."""
    if list(expected) == list(got):
        return None
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))


def first_differences(
    target: Target,
    prompt_ids: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> list[dict]:
    """The first difference of each output from its reference (plain greedy decoding), judged by the target.

    Args:
      target: the target both outputs came from.
      prompt_ids: each prompt's token ids.
      reference: each prompt's plain greedy tokens.
      outputs: each prompt's tokens from the method compared.

    Returns:
      One record per differing prompt: prompt (its index), position, reference_token and token (None past
      an output's end), gap (the reference token's logit minus the other's), top2_gap (the two best
      logits' distance) and ranks (each token's rank, 0 = the best), from a one-pass forward of the prompt
      and the common prefix.
    """
    records = []
    for index, (prompt, expected, got) in enumerate(zip(prompt_ids, reference, outputs)):
        position = first_difference(expected, got)
        if position is None:
            continue
        logits = sequence_logits(target, list(prompt) + list(expected[:position]))[-1].astype(np.float64)
        best = np.sort(logits)[-2:]
        tokens = [seq[position] if position < len(seq) else None for seq in (expected, got)]
        gap = None if None in tokens else float(logits[tokens[0]] - logits[tokens[1]])
        records.append(
            {
                "prompt": index,
                "position": position,
                "reference_token": tokens[0],
                "token": tokens[1],
                "gap": gap,
                "top2_gap": float(best[1] - best[0]),
                "ranks": [None if tok is None else int(np.sum(logits > logits[tok])) for tok in tokens],
            }
        )
    return records
