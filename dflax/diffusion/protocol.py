"""What DiffuSpec needs from a masked diffusion LM: its own state of the committed prefix, and the logits
of a window of slots after it in one forward.

Every diffusion LM dflax runs as a drafter implements `DiffusionLM`: Dream and LLaDA checkpoints (fully
bidirectional, so their state is the token history and each forward re-reads a bounded recent context)
and the small drafter adapted from the target (causal over the committed prefix, so its state is a KV
cache, and bidirectional inside the window). The decode loop calls `observe` with the tokens it commits
and `window_logits` once per refinement step.

Positions follow dflax.decoding.decode: `length` [B] tokens of a row are committed and held by the
state; the newest committed token `last_token` sits at position `length` and is not held yet. The window
is the K slots at positions length + 1 .. length + K.

Glossary: B batch, S slots of the state, T tokens observed at once, K window slots, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp


class DiffusionLM(Protocol):
    """A masked diffusion LM bound to its parameters' structure (static; parameters travel as a pytree).

    Attributes:
      mask_token_id: the id that marks a slot still to be filled.
      vocab_size: V, the width of its logits (the target's vocabulary ids, shared tokenizer).
    """

    mask_token_id: int
    vocab_size: int

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype) -> Any:
        """The state of an empty prefix for `batch` rows of up to `slots` committed tokens."""

    def observe(
        self, params: Any, state: Any, tokens: jax.Array, positions: jax.Array, count: jax.Array
    ) -> Any:
        """The state after committing the first `count` [B] of `tokens` [B, T] at `positions` [B, T]
        (entries past `count` are padding and must not change what later calls see)."""

    def window_logits(
        self, params: Any, state: Any, last_token: jax.Array, length: jax.Array, window: jax.Array
    ) -> jax.Array:
        """Logits [B, K, V] (float32) for the window's slots given the committed prefix.

        Args:
          params: the model's parameters.
          state: the state after observing `length` [B] committed tokens.
          last_token: [B] the newest committed token, at position `length`.
          length: [B] int32 committed tokens the state holds.
          window: [B, K] int32 the window's current tokens, `mask_token_id` where still unknown (all of
            them on the first refinement step).

        Returns:
          [B, K, V] logits of the token at each window slot (a model whose logits are shifted by one
          position, as Dream's, applies the shift here).
        """
