"""Filling DiffuSpec's masked window in R forwards of a diffusion LM (R = 1 by default, as published).

All K slots start as the mask token. Each of the first R - 1 forwards fixes its most confident still-masked
slots (the highest top probability) to their most likely token, about K / R slots per forward; the last
forward scores every slot given the fixed ones. A fixed slot's distribution is then one-hot at its token,
so the lattice holds it alone. One forward (R = 1) is the paper's choice: more steps raise acceptance a
little and cost a forward each.

Glossary: B batch, K window slots, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dflax.decoding.sampling import NEG_INF, first_argmax
from dflax.diffusion.protocol import DiffusionLM


def unmask_counts(window: int, steps: int) -> list[int]:
    """Slots fixed by each of the first R - 1 forwards: ceil(K (r + 1) / R) - ceil(K r / R)."""
    ceil = lambda a: -(-a // steps)
    return [ceil(window * (r + 1)) - ceil(window * r) for r in range(steps - 1)]


def window_log_probs(
    model: DiffusionLM,
    params: Any,
    state: Any,
    last_token: jax.Array,
    length: jax.Array,
    window: int,
    steps: int,
    vocab_size: int | None = None,
) -> jax.Array:
    """Per-slot log probabilities [B, K, V] of the window after `steps` refinement forwards.

    Args:
      model: the diffusion LM.
      params: its parameters.
      state: its state of the committed prefix.
      last_token: [B] the newest committed token (at position `length`).
      length: [B] int32 committed tokens the state holds.
      window: K, slots drafted after the last token.
      steps: R >= 1 forwards (R <= K).
      vocab_size: V, read only the first V logits (a padded vocabulary wider than the target's); None =
        all of them.

    Returns:
      [B, K, V] float32 log probabilities; slots fixed by an earlier forward are one-hot (0 at their token,
      NEG_INF elsewhere).
    """
    b = last_token.shape[0]

    def forward(tokens):  # [B, K] -> [B, K, V] log probabilities
        logits = model.window_logits(params, state, last_token, length, tokens)[..., :vocab_size]
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    tokens = jnp.full((b, window), model.mask_token_id, jnp.int32)  # [B, K]
    fixed = jnp.zeros((b, window), jnp.bool_)
    for count in unmask_counts(window, steps):
        log_q = forward(tokens)
        confidence = jnp.where(fixed, -jnp.inf, jnp.max(log_q, axis=-1))  # [B, K]
        _, chosen = jax.lax.top_k(confidence, count)  # [B, count]
        newly = jnp.any(jax.nn.one_hot(chosen, window, dtype=jnp.bool_), axis=1)  # [B, K]
        tokens = jnp.where(newly, first_argmax(log_q), tokens)
        fixed |= newly
    log_q = forward(tokens)
    one_hot = jnp.where(jnp.arange(log_q.shape[-1]) == tokens[..., None], 0.0, NEG_INF)  # [B, K, V]
    return jnp.where(fixed[..., None], one_hot, log_q).astype(jnp.float32)
