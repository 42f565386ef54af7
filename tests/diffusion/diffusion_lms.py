"""Test-only `DiffusionLM`s: any implementation of the protocol plugs into DiffuSpec.

- `TableDiffusionLM`: random logits, a fixed function of the last committed token, the slot and the
  window's already fixed tokens (so refinement steps change what later forwards see). Stateless; any
  window up to the table's.
- `OracleDiffusionLM`: its parameters are each row's text by position (prompt + the target's greedy
  output); slot j scores the token at position length + 1 + j with `true_logit`, and the next token id
  with `decoy_logit` (so the lattice holds two members when the logits are soft). `wrong_slot` puts the
  decoy first there: acceptance stops at that slot.

Glossary: B batch, K window slots, V vocabulary, R reference length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TableDiffusionLM:
    """logits[b, j] = table[last_token[b], j] + table[window[b, j'], j] summed over fixed slots j'."""

    vocab_size: int
    window: int
    mask_token_id: int = 0

    def make_params(self, seed: int, scale: float) -> jax.Array:
        """A random [V, K, V] table of logits."""
        shape = (self.vocab_size, self.window, self.vocab_size)
        return scale * jax.random.normal(jax.random.key(seed), shape)

    def init_state(self, batch, slots, dtype):
        return None

    def observe(self, params, state, tokens, positions, count):
        return None

    def window_logits(self, params, state, last_token, length, window):
        k = window.shape[1]  # at most the table's window
        logits = params[last_token][:, :k]  # [B, K, V]
        fixed = window != self.mask_token_id  # [B, K]
        extra = jnp.where(fixed[..., None, None], params[window][:, :, :k], 0.0).sum(axis=1)  # [B, K, V]
        return (logits + 0.5 * extra).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class OracleDiffusionLM:
    """Drafts the reference text (see the module docstring); params: [B, R] int32 tokens by position."""

    vocab_size: int
    true_logit: float = 30.0
    decoy_logit: float = 0.0
    wrong_slot: int | None = None
    mask_token_id: int = 0

    def init_state(self, batch, slots, dtype):
        return None

    def observe(self, params, state, tokens, positions, count):
        return None

    def window_logits(self, params, state, last_token, length, window):
        k = window.shape[1]
        index = jnp.minimum(length[:, None] + 1 + jnp.arange(k), params.shape[1] - 1)  # [B, K]
        true = jnp.take_along_axis(params, index, axis=1)  # [B, K]
        decoy = (true + 1) % self.vocab_size
        first, second = true, decoy
        if self.wrong_slot is not None:
            swap = jnp.arange(k) == self.wrong_slot
            first, second = jnp.where(swap, decoy, true), jnp.where(swap, true, decoy)
        vocab = jnp.arange(self.vocab_size)
        logits = jnp.where(vocab == first[..., None], self.true_logit, 0.0)
        return jnp.where(vocab == second[..., None], self.decoy_logit, logits).astype(jnp.float32)


def reference_texts(prompts: list[list[int]], outputs: list[list[int]], length: int) -> jax.Array:
    """[B, length] each row's prompt followed by its output, by position (zeros after)."""
    table = np.zeros((len(prompts), length), np.int32)
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        text = (p + o)[:length]
        table[r, : len(text)] = text
    return jnp.asarray(table)
