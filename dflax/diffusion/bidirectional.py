"""A fully bidirectional masked diffusion LM (Dream, LLaDA) as a `DiffusionLM`: token history as state, one
forward per refinement step over a bounded recent context.

Dream and LLaDA are dflax targets with the causal mask taken away: the same decoder layers (RMSNorm, RoPE,
grouped-query attention, SwiGLU), run over every token at once with every valid token visible to every
other. So the module here IS `dflax.models.transformer.Transformer` (same submodules, parameter tree and
read-out) with one more method, `bidirectional`, that runs its layers with a bidirectional mask over an empty
cache (`Transformer.__call__` promises the attention a causal mask, which lets the CPU path skip keys; that
promise does not hold here). The loaders map each checkpoint onto that parameter tree
(dflax.diffusion.dream, dflax.diffusion.llada).

Such a model has no reusable cache of the committed prefix: every token sees the window, so every token's
keys change with it. Its state is the committed token history (`dflax.drafters.lookup.History`), and each
`window_logits` re-reads the most recent `context` committed tokens:

    slots   [0, C)        the row's last min(length, C) committed tokens, right-aligned (left padding)
    slot    C             last_token (position `length`)
    slots   [C+1, C+1+K)  the window (positions length + 1 .. length + K)

Padding slots are invisible as keys; a row's first valid token gets RoPE position 0, as Dream's own batched
generation numbers a left-padded row. Dream predicts the token at position p from its hidden state at p - 1
(it was adapted from an autoregressive model), so window slot j reads the hidden state of slot C + j; LLaDA
reads slot C + 1 + j.

Glossary: B batch, S history slots, C context tokens, K window slots, N = C + 1 + K tokens per forward,
D model width, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflax.drafters.lookup import History
from dflax.models.transformer import Transformer

DEFAULT_CONTEXT = 256


class BidirectionalTransformer(Transformer):
    """dflax's decoder stack run without a causal mask (parameters exactly those of `Transformer`)."""

    def bidirectional(self, tokens: jax.Array, positions: jax.Array, key_valid: jax.Array) -> jax.Array:
        """Final hidden states of a whole sequence in which every token sees every valid token.

        Args:
          tokens: [B, N] int32.
          positions: [B, N] int32 RoPE positions.
          key_valid: [B, N] bool, which tokens are seen (padding is not). Every row needs one valid token.

        Returns:
          [B, N, D] hidden states after the final norm (padding rows hold values nobody should read).
        """
        b, n = tokens.shape
        cfg = self.config
        empty = jnp.zeros((b, cfg.num_kv_heads, 0, cfg.head_dim), self.dtype)  # [B, K, 0, H]: no cache
        no_cache = jnp.zeros((b,), jnp.int32)
        mask = jnp.broadcast_to(key_valid[:, None, :], (b, n, n))  # [B, N, N] query i sees valid key j
        x = self.embed(tokens)  # [B, N, D]
        for layer in self.layers:
            x, _, _ = layer(x, positions, empty, empty, no_cache, mask, empty_cache=True, causal=False)
        return self.norm(x)


@dataclasses.dataclass(frozen=True)
class BidirectionalDiffusionLM:
    """A Dream or LLaDA checkpoint as a `dflax.diffusion.protocol.DiffusionLM` (see the module docstring).

    Attributes:
      module: the decoder stack (its parameters are the `params` the protocol methods take).
      mask_token_id: the id of a slot still to be filled.
      logit_shift: True for Dream (slot p's logits come from the hidden state at p - 1), False for LLaDA.
      context: C, the most recent committed tokens each forward reads (static: one compiled shape).
      name: "dream" or "llada", for messages.
    """

    module: BidirectionalTransformer
    mask_token_id: int
    logit_shift: bool
    context: int = DEFAULT_CONTEXT
    name: str = "diffusion LM"

    def __post_init__(self):
        if self.context < 0:
            raise ValueError(f"context must be >= 0 committed tokens, got {self.context}")

    @property
    def vocab_size(self) -> int:
        """V, the width of the logits (the embedding table's rows)."""
        return self.module.config.vocab_size

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype = jnp.int32) -> History:
        """An empty history of `slots` positions per row (`dtype` is unused: the state holds token ids)."""
        del dtype
        return History(tokens=jnp.zeros((batch, slots), jnp.int32))

    def observe(
        self, params: dict, state: History, tokens: jax.Array, positions: jax.Array, count: jax.Array
    ) -> History:
        """Writes the first `count` [B] of `tokens` [B, T] at `positions` [B, T]; the rest is dropped."""
        del params
        b, t = tokens.shape
        slots = state.tokens.shape[1]
        kept = jnp.arange(t)[None, :] < count[:, None]  # [B, T]
        where = jnp.where(kept, positions, slots)  # [B, T] slot `slots` is out of range: dropped
        rows = jnp.arange(b)[:, None]
        return History(tokens=state.tokens.at[rows, where].set(tokens.astype(jnp.int32), mode="drop"))

    def window_logits(
        self, params: dict, state: History, last_token: jax.Array, length: jax.Array, window: jax.Array
    ) -> jax.Array:
        """Logits [B, K, V] float32 of the window's slots from one bidirectional forward (see module doc).

        Args:
          params: the module's parameters.
          state: the history holding `length` [B] committed tokens per row.
          last_token: [B] the newest committed token, at position `length`.
          length: [B] int32 committed tokens in the history.
          window: [B, K] int32 current window tokens, `mask_token_id` where unknown.
        """
        tokens, positions, valid = assemble_sequence(state.tokens, length, last_token, window, self.context)
        hidden = self.module.apply(params, tokens, positions, valid, method="bidirectional")  # [B, N, D]
        k = window.shape[1]
        first = self.context if self.logit_shift else self.context + 1
        return self.module.apply(params, hidden[:, first : first + k], method="logits")  # [B, K, V]


def assemble_sequence(
    history: jax.Array, length: jax.Array, last_token: jax.Array, window: jax.Array, context: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The static [context | last_token | window] layout of one forward.

    Args:
      history: [B, S] int32 committed tokens by position (valid below `length`).
      length: [B] int32 committed tokens per row.
      last_token: [B] int32 the token at position `length`.
      window: [B, K] int32.
      context: C.

    Returns:
      (tokens [B, N], RoPE positions [B, N] (0 at the row's first valid token), valid [B, N] bool).
    """
    b = history.shape[0]
    k = window.shape[1]
    kept = jnp.minimum(length, context)  # [B] committed tokens the forward reads
    index = length[:, None] - context + jnp.arange(context)[None, :]  # [B, C] history slot of each slot
    context_tokens = jnp.take_along_axis(history, jnp.maximum(index, 0), axis=1)  # [B, C]
    tokens = jnp.concatenate([context_tokens, last_token[:, None].astype(jnp.int32), window], axis=1)
    valid = jnp.concatenate([index >= 0, jnp.ones((b, 1 + k), bool)], axis=1)  # [B, N]
    positions = jnp.arange(context + 1 + k)[None, :] - (context - kept)[:, None]  # [B, N]
    return tokens.astype(jnp.int32), jnp.maximum(positions, 0).astype(jnp.int32), valid
