"""DiffuSpec's token lattice: per window slot, the diffusion LM's few plausible tokens (arXiv 2510.02358).

At every slot the candidates are the smallest top set of the drafter's distribution whose mass reaches
`mass` (0.8 as published), at most `max_set` (15) tokens, most likely first. End-of-sequence tokens are
ordinary members (kept when they are among the top tokens, never dropped as special tokens). A slot whose
set holds nothing but end-of-sequence tokens is a certain EOS: the lattice ends there (that slot
included), since nothing after an emitted EOS is ever used.

Static shapes: every slot has `max_set` columns, `valid` says which are members.

Glossary: B batch, K window slots, M = max_set columns, V vocabulary, E end-of-sequence ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

LATTICE_MASS = 0.8
LATTICE_MAX_SET = 15


@struct.dataclass
class Lattice:
    """Per-slot candidate sets.

    Attributes:
      tokens: [B, K, M] int32 candidates, most likely first.
      log_q: [B, K, M] float32 their log probabilities under the drafter (the full softmax, not renormalised).
      valid: [B, K, M] bool, members of the slot's set (column 0 always is).
      length: [B] int32 slots in the lattice: up to and including the first certain EOS, else K.
    """

    tokens: jax.Array
    log_q: jax.Array
    valid: jax.Array
    length: jax.Array


def token_lattice(
    log_q: jax.Array,
    eos_ids: jax.Array,
    mass: float = LATTICE_MASS,
    max_set: int = LATTICE_MAX_SET,
) -> Lattice:
    """The lattice of a window's per-slot distributions.

    Args:
      log_q: [B, K, V] float32 log probabilities of each slot (a log_softmax).
      eos_ids: [E] int32 end-of-sequence ids.
      mass: a slot keeps its most likely tokens until their mass reaches this.
      max_set: M, the most tokens a slot keeps.

    Returns:
      The `Lattice` (columns beyond a slot's set are not members).
    """
    m = min(max_set, log_q.shape[-1])
    top_log_q, top_tokens = jax.lax.top_k(log_q, m)  # [B, K, M]
    probs = jnp.exp(top_log_q)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, K, M] mass of the more likely members
    valid = mass_before < mass
    valid = valid.at[..., 0].set(True)
    is_eos = jnp.any(top_tokens[..., None] == eos_ids, axis=-1)  # [B, K, M]
    certain_eos = jnp.all(is_eos | ~valid, axis=-1)  # [B, K]
    k = log_q.shape[1]
    first = jnp.min(jnp.where(certain_eos, jnp.arange(k), k), axis=-1)  # [B]
    return Lattice(
        tokens=top_tokens.astype(jnp.int32),
        log_q=top_log_q.astype(jnp.float32),
        valid=valid,
        length=jnp.minimum(first + 1, k).astype(jnp.int32),
    )
