"""The DFlash 2 drafter (dflax.drafters.dflash2) as the decode loop's `Proposer`, and its loader.

Each step is one drafter forward over [anchor, MASK x n] at the row's next positions, attending to the
context cache that `observe` fills with the committed tokens' fused target features (as DFlash's). The
draft hidden states are read out through the target's LM head over the whole vocabulary, *without* the
target's own final soft cap (`scale_logits` applies the drafter's multiplier and cap), and the candidate
selector turns them into the chain of n drafts:

- greedy drafts: the selector's argmax path, verified by the delta rule (no q);
- sampled drafts: the selector's path drawn at the draft temperature, sent with the q rows each draft was
  drawn from (softmax of the selector's scores over its M candidates given the path before it, 0 outside
  them) as [B, n, V] log-probabilities, so block verification sees exactly the proposal distributions.

Only chains: the selector conditions each draft on the one before it, so a best-first tree over
per-position marginals would not be what it drafts (tree budget 0 only).

Glossary: B batch, n = block_size - 1 drafts, D width, M selector candidates, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from dflax.decoding.sampling import NEG_INF
from dflax.drafters.dflash import DraftSampling
from dflax.drafters.dflash2 import DFlash2Config, DFlash2Drafter
from dflax.drafters.dflash2_checkpoint import is_dflash2_config, load_dflash2_checkpoint
from dflax.models.cache import KVCache, write_kv
from dflax.models.transformer import Transformer
from dflax.sharding.embedding import take_rows


def scatter_log_q(candidates: jax.Array, q: jax.Array, vocab_size: int) -> jax.Array:
    """The selector's q rows over its candidates -> log-probabilities over the whole vocabulary.

    Args:
      candidates: [B, n, M] int32 distinct token ids.
      q: [B, n, M] float32 probabilities over them.
      vocab_size: V.

    Returns:
      [B, n, V] float32 log q, NEG_INF outside the candidates (and where q underflows to 0).
    """
    log_q = jnp.where(q > 0, jnp.log(jnp.maximum(q, 1e-38)), NEG_INF)  # [B, n, M]
    full = jnp.full(q.shape[:-1] + (vocab_size,), NEG_INF, jnp.float32)  # [B, n, V]
    b, n, _ = q.shape
    rows = jnp.arange(b)[:, None, None]
    positions = jnp.arange(n)[None, :, None]
    return full.at[rows, positions, candidates].set(log_q)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlash2Proposer:
    """The DFlash 2 drafter as the decode loop's `Proposer` (static; parameters are passed in).

    Attributes:
      module: the drafter module.
      target: the target module whose embedding and LM head the drafter shares.
      block_size: B at decode time (the anchor + B - 1 drafts).
      draft_sampling: greedy drafts (the selector's argmax path, delta rule) or sampled drafts (the path
        drawn at `draft_sampling.temperature`, block verification with the selector's q rows).
      tree_budget: 0 only (chains; see the module docstring).
    """

    module: DFlash2Drafter
    target: Transformer
    block_size: int
    draft_sampling: DraftSampling = DraftSampling()
    tree_budget: int = 0

    def __post_init__(self):
        if self.tree_budget:
            raise ValueError(
                f"DFlash 2 drafters propose chains only (tree budget 0), got a tree budget of "
                f"{self.tree_budget}: the candidate selector drafts each token given the one before it, "
                "so there is no per-position distribution to grow a best-first tree from"
            )
        if self.block_size < 2:
            raise ValueError(
                f"block size must be >= 2 (the anchor plus at least one draft), got {self.block_size}"
            )

    # A DFlash 2 drafter reads out the whole vocabulary (dflax.bench reports a drafter's draft vocabulary).
    draft_vocab = None

    @property
    def block_drafts(self) -> int:
        """block_size - 1 positions drafted by one drafter forward."""
        return self.block_size - 1

    @property
    def num_draft(self) -> int:
        """Drafts verified per step (the chain's n)."""
        return self.block_drafts

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the drafter fuses."""
        return self.module.config.target_layer_ids

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype) -> KVCache:
        """An empty context cache with as many slots as the target's."""
        return KVCache.init(self.module.config.layers, batch, slots, dtype)

    def observe(self, params, drafter_state: KVCache, tokens, taps, positions, count) -> KVCache:
        """Projects the new tokens' target features into the context cache and keeps the first `count`."""
        features = jnp.concatenate(taps, axis=-1)  # [B, T, K * D]
        ks, vs = self.module.apply(params, features, positions, method=DFlash2Drafter.context_kv)
        start = drafter_state.lengths
        return drafter_state.replace(
            k=tuple(write_kv(buf, k, start) for buf, k in zip(drafter_state.k, ks)),
            v=tuple(write_kv(buf, v, start) for buf, v in zip(drafter_state.v, vs)),
            lengths=start + count,
        )

    def draft_hidden(
        self, params, target_params, last_token: jax.Array, start: jax.Array, context: KVCache
    ) -> jax.Array:
        """One drafter forward per row over [anchor, MASK x n] (the target's raw embedding rows).

        Args:
          last_token: [B] the anchor (last committed) token of each row.
          start: [B] int32 the anchor's absolute position.
          context: the context cache (its `lengths` = start).

        Returns:
          [B, n + 1, D] final hidden states; position k (1..n) is read out for the token at start + k.
        """
        embedding = target_params["params"]["embed_tokens"]["weight"]  # [V, D]
        anchor = take_rows(embedding, last_token)[:, None]  # [B, 1, D]
        mask = embedding[self.module.config.mask_token_id]  # [D]
        masks = jnp.broadcast_to(mask, (anchor.shape[0], self.block_drafts, anchor.shape[-1]))  # [B, n, D]
        block = jnp.concatenate([anchor, masks], axis=1)  # [B, n + 1, D]
        positions = start[:, None] + jnp.arange(self.block_drafts + 1, dtype=jnp.int32)  # [B, n + 1]
        return self.module.apply(params, block, positions, context)

    def raw_logits(self, target_params, hidden: jax.Array) -> jax.Array:
        """The target's LM head without its final soft cap: [..., D] -> [..., V] float32 (the drafter's
        `scale_logits` applies its own multiplier and cap)."""
        uncapped = dataclasses.replace(self.target.config, final_logit_softcapping=None)
        return self.target.clone(config=uncapped).apply(target_params, hidden, method=Transformer.logits)

    def propose(self, params, target_params, state, keys) -> tuple[jax.Array, jax.Array | None]:
        """Drafts n tokens per row: the selector's path over one drafter forward.

        Returns:
          (drafts [B, n] int32, None for greedy drafts or log q [B, n, V] for sampled ones).
        """
        hidden = self.draft_hidden(
            params, target_params, state.last_token, state.cache.positions, state.drafter_state
        )[:, 1:]  # [B, n, D]
        raw = self.raw_logits(target_params, hidden)  # [B, n, V]
        anchor = state.last_token.astype(jnp.int32)
        if self.draft_sampling.mode == "greedy":
            path, _, _ = self.module.apply(params, hidden, raw, anchor, 0.0, method=DFlash2Drafter.propose)
            return path, None
        uniforms = jax.vmap(lambda key: jax.random.uniform(key, (self.block_drafts,)))(keys)  # [B, n]
        temperature = self.draft_sampling.temperature
        path, candidates, q = self.module.apply(
            params, hidden, raw, anchor, temperature, uniforms, method=DFlash2Drafter.propose
        )  # [B, n], [B, n, M], [B, n, M]
        return path, scatter_log_q(candidates, q, raw.shape[-1])


def is_dflash2_dir(path: Path) -> bool:
    """Whether a drafter directory holds a DFlash 2 drafter (by its config.json)."""
    config = Path(path) / "config.json"
    return config.is_file() and is_dflash2_config(json.loads(config.read_text()))


def check_target(config: DFlash2Config, target) -> None:
    """Raises ValueError with the fix when the DFlash 2 drafter cannot serve `target` (a ModelConfig):
    hidden size, vocabulary, tapped layers, mask token."""
    try:
        config.base.check_target(target)
    except ValueError as e:
        raise ValueError(str(e).replace("this DFlash drafter", "this DFlash 2 drafter", 1)) from None


def load_dflash2(
    path: Path, target, block_size: int | None, draft_sampling: DraftSampling
) -> tuple[DFlash2Config, dict, DFlash2Proposer]:
    """A DFlash 2 drafter directory bound to a loaded `dflax.target.Target`: (config, params, proposer).

    Raises:
      ValueError: when the drafter does not fit the target.
      FileNotFoundError / CheckpointError: for a missing or broken checkpoint.
    """
    config, params = load_dflash2_checkpoint(path, target.dtype)
    check_target(config, target.config)
    module = DFlash2Drafter(config, target.dtype, target.module.attention_backend)
    proposer = DFlash2Proposer(module, target.module, block_size or config.block_size, draft_sampling)
    return config, params, proposer
