"""DART: one causal layer drafts d future tokens in one forward from fused target features (arXiv 2601.19278).

Every committed position i becomes one 2D-wide input, EAGLE-3 style: the target's hidden states after
three chosen layers (by default 1, N/2 - 1 and N - 4), concatenated and fused by `fc` to D, next to the
embedding of the NEXT token x_{i+1}; q/k/v read the 2D vector. To draft, d - 1 copies of a learned 2D mask
vector follow the last committed position, and attention is strictly causal, inside the mask block too.
The read-out is shifted: with tokens up to x_{n+1} committed (x_{n+1}, the last one, has no target
features yet), the last position n predicts x_{n+2} and mask i predicts x_{n+2+i}, so one forward gives
the logits of d future tokens. The LM head is the drafter's own, optionally over a reduced vocabulary
(dflax.drafters.draft_vocab); the embedding is the target's, shared and frozen.

The drafter keeps the projected K/V of every committed position whose next token is known in its own
one-layer cache (slot = position + 1; slot 0 is never read) and the fused-layer features of the newest
position (`pending`), whose next token is the last committed one. Trees over the d positions are DART's
n-gram-pruned beam (dflax.drafters.dart_tree); a chain is the argmax at each position.

Glossary: B batch, T tokens, S cache slots, D width, K fused target layers, V' draft vocabulary,
d drafted positions, N query heads, G query heads per KV head, H head dim.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflax.decoding.sampling import NEG_INF, first_argmax
from dflax.decoding.tree import DraftTree
from dflax.drafters.dart_tree import BeamSettings, NgramPrior, dart_tree
from dflax.models.cache import KVCache, write_kv
from dflax.models.config import ModelConfig
from dflax.models.layers import GatedMLP, Linear, RMSNorm, apply_rope, rope_inv_freq
from dflax.models.transformer import Transformer
from dflax.sharding.embedding import take_rows

DART_NUM_DRAFT = 8  # the last committed position + 7 masks (the paper's d)


def default_dart_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """The published taps: outputs of layers 1, N/2 - 1 and N - 4 (fewer distinct ones for tiny targets)."""
    ids = (1, num_target_layers // 2 - 1, num_target_layers - 4)
    return tuple(sorted({min(max(i, 0), num_target_layers - 1) for i in ids}))


@dataclasses.dataclass(frozen=True)
class DartConfig:
    """A DART drafter's architecture.

    Attributes:
      layer: its one decoder layer (width, heads and FFN of the target; num_layers 1); q/k/v read 2D inputs.
      num_draft: d, tokens drafted per forward (the last position + d - 1 masks).
      target_layer_ids: target layers whose outputs are fused (HF hidden_states[l + 1]).
      draft_vocab_size: V', rows of the drafter's own LM head (the target's V without a reduced vocabulary).
      feature_norm: RMS-normalize each tapped layer's features before `fc` (a dflax option, as for DFlash:
        SmolLM2's few huge activation dimensions otherwise swamp `fc`).
    """

    layer: ModelConfig
    num_draft: int
    target_layer_ids: tuple[int, ...]
    draft_vocab_size: int
    feature_norm: bool = False

    def __post_init__(self):
        if self.num_draft < 1:
            raise ValueError(f"a DART drafter drafts at least one position, got num_draft {self.num_draft}")
        if not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, {self.layer.vocab_size}], got {self.draft_vocab_size}"
            )

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        num_draft: int = DART_NUM_DRAFT,
        target_layer_ids: tuple[int, ...] | None = None,
        draft_vocab_size: int | None = None,
        feature_norm: bool = False,
    ) -> DartConfig:
        """A drafter at the target's width, heads and FFN (the published taps by default)."""
        layer = ModelConfig(
            arch="llama",
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_layers=1,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            tie_word_embeddings=False,
            max_position_embeddings=target.max_position_embeddings,
        )
        ids = target_layer_ids if target_layer_ids is not None else default_dart_layer_ids(target.num_layers)
        return cls(layer, num_draft, tuple(ids), draft_vocab_size or target.vocab_size, feature_norm)

    def check_target(self, target: ModelConfig) -> None:
        """Raises ValueError with the fix when this drafter cannot serve `target`."""
        problems = []
        if self.layer.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.layer.hidden_size} != target's {target.hidden_size}")
        if self.layer.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.layer.vocab_size} != target's {target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
        if problems:
            raise ValueError(
                "this DART drafter was not built for this target: "
                + "; ".join(problems)
                + ". Use a drafter trained for this target (or train one with `dflax train`)."
            )


def attention(q, ctx_k, ctx_v, ctx_mask, own_k, own_v):
    """Causal attention of T queries over shared context keys plus their own T keys (float32 softmax).

    Args:
      q: [B, M, T, N, H] queries (M query groups share one context per row).
      ctx_k, ctx_v: [B, K, S, H] context keys/values (head-major, as the KV cache stores them).
      ctx_mask: [B, M, T, S] bool, which context slots each query sees.
      own_k, own_v: [B, M, T, K, H] the queries' own keys/values; query t sees own keys 0..t.

    Returns:
      [B, M, T, N, H] in q's dtype.
    """
    b, m, t, n, h = q.shape
    k_heads = own_k.shape[3]
    if ctx_k.shape[1] != k_heads:
        raise ValueError(f"context keys {ctx_k.shape} are not head-major [B, K, S, H] with K = {k_heads}")
    qg = q.reshape(b, m, t, k_heads, n // k_heads, h).astype(jnp.float32) * h**-0.5
    ctx = jnp.einsum("bmtkgh,bksh->bmkgts", qg, ctx_k.astype(jnp.float32))  # [B, M, K, G, T, S]
    own = jnp.einsum("bmtkgh,bmukh->bmkgtu", qg, own_k.astype(jnp.float32))  # [B, M, K, G, T, T]
    ctx = jnp.where(ctx_mask[:, :, None, None], ctx, NEG_INF)
    own = jnp.where(jnp.tril(jnp.ones((t, t), jnp.bool_)), own, NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([ctx, own], axis=-1), axis=-1)
    s = ctx_k.shape[2]
    out = jnp.einsum("bmkgts,bksh->bmtkgh", probs[..., :s], ctx_v.astype(jnp.float32))
    out += jnp.einsum("bmkgtu,bmukh->bmtkgh", probs[..., s:], own_v.astype(jnp.float32))
    return out.reshape(b, m, t, n, h).astype(q.dtype)


class DartAttention(nn.Module):
    """GQA self-attention whose q/k/v read 2D-wide inputs and whose output is D wide (RoPE on q and k)."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        self.q_proj = Linear(cfg.num_heads * cfg.head_dim, dtype=self.dtype)
        self.k_proj = Linear(cfg.num_kv_heads * cfg.head_dim, dtype=self.dtype)
        self.v_proj = Linear(cfg.num_kv_heads * cfg.head_dim, dtype=self.dtype)
        self.o_proj = Linear(cfg.hidden_size, dtype=self.dtype)
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def _heads(self, x, heads, positions):  # [B, T, heads * H] -> [B, T, heads, H] rotated
        y = x.reshape(*x.shape[:-1], heads, self.config.head_dim)
        return apply_rope(y, positions, self.inv_freq)

    def project_kv(self, u: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[B, T, 2D] inputs at [B, T] positions -> keys and values [B, T, K, H]."""
        k = self._heads(self.k_proj(u), self.config.num_kv_heads, positions)
        v = self.v_proj(u).reshape(*u.shape[:-1], self.config.num_kv_heads, self.config.head_dim)
        return k, v

    def __call__(self, u, positions, ctx_k, ctx_v, ctx_mask):
        """Attention of [B, M, T, 2D] inputs at [B, M, T] positions over a context and themselves (causal).

        Returns:
          [B, M, T, D].
        """
        b, m, t, _ = u.shape
        flat_u, flat_pos = u.reshape(b * m, t, -1), positions.reshape(b * m, t)
        q = self._heads(self.q_proj(flat_u), self.config.num_heads, flat_pos)
        k, v = self.project_kv(flat_u, flat_pos)
        split = lambda x: x.reshape(b, m, *x.shape[1:])
        out = attention(split(q), ctx_k, ctx_v, ctx_mask, split(k), split(v))  # [B, M, T, N, H]
        return self.o_proj(out.reshape(b, m, t, -1))


class DartDrafter(nn.Module):
    """DART's parameters and forward (the embedding comes from the target).

    Parameter names follow EAGLE-3's layout, which DART's drafter extends: fc, midlayer/{hidden_norm,
    input_layernorm, self_attn, post_attention_layernorm, mlp}, norm, lm_head, plus mask_embedding [2D].
    """

    config: DartConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config.layer
        self.fc = Linear(cfg.hidden_size, dtype=self.dtype)
        self.midlayer = DartLayer(cfg, self.dtype)
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        self.lm_head = Linear(self.config.draft_vocab_size, dtype=self.dtype)
        self.mask_embedding = self.param(
            "mask_embedding", nn.initializers.normal(0.02), (2 * cfg.hidden_size,), self.dtype
        )

    def fuse(self, features: jax.Array, next_embeds: jax.Array) -> jax.Array:
        """[..., K * D] target features and [..., D] next-token embeddings -> [..., 2D] layer inputs."""
        features = features.astype(self.dtype)
        if self.config.feature_norm:
            taps = features.reshape(*features.shape[:-1], len(self.config.target_layer_ids), -1)
            taps = taps.astype(jnp.float32)
            taps = taps * jax.lax.rsqrt(jnp.mean(taps**2, axis=-1, keepdims=True) + 1e-6)  # [..., K, D]
            features = taps.reshape(features.shape).astype(self.dtype)
        return self.midlayer.fuse(self.fc(features), next_embeds.astype(self.dtype))

    def context_kv(self, u: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, T, K, H] of committed positions' inputs u [B, T, 2D]."""
        return self.midlayer.self_attn.project_kv(u, positions)

    def __call__(self, u, positions, ctx_k, ctx_v, ctx_mask) -> jax.Array:
        """The layer over [B, M, T, 2D] inputs (see `DartAttention`) -> [B, M, T, D] normed hidden states."""
        return self.norm(self.midlayer(u, positions, ctx_k, ctx_v, ctx_mask))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., D] -> [..., V'] float32 logits of the drafter's own LM head."""
        return self.lm_head(hidden).astype(jnp.float32)

    def mask_vector(self) -> jax.Array:
        """The learned mask input [2D]."""
        return self.mask_embedding

    def init_all(self, features, next_embeds, positions):
        """Touches every parameter (for `init`)."""
        u = self.fuse(features, next_embeds)[:, None]  # [B, 1, T, 2D]
        b, _, t, _ = u.shape
        k, v = self.context_kv(u[:, 0], positions)  # [B, T, K, H]
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H], the cache's layout
        hidden = self(u, positions[:, None], k, v, jnp.ones((b, 1, t, t), jnp.bool_))
        return self.logits(hidden), self.mask_vector()


class DartLayer(nn.Module):
    """The one decoder layer: u = [input_layernorm(embedding), hidden_norm(fc(features))] (2D) -> q/k/v;
    the residual stream starts from the fused half of u."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        self.self_attn = DartAttention(cfg, self.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        self.mlp = GatedMLP(cfg.intermediate_size, dtype=self.dtype)

    def fuse(self, fused: jax.Array, next_embeds: jax.Array) -> jax.Array:
        """[..., D] fc outputs and [..., D] embeddings -> [..., 2D]."""
        return jnp.concatenate([self.input_layernorm(next_embeds), self.hidden_norm(fused)], axis=-1)

    def __call__(self, u, positions, ctx_k, ctx_v, ctx_mask):
        h = u[..., self.config.hidden_size :] + self.self_attn(u, positions, ctx_k, ctx_v, ctx_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def init_dart_params(module: DartDrafter, seed: int = 0) -> dict:
    """Random parameters for a DART drafter (untrained: tau near 1)."""
    cfg = module.config
    d = cfg.layer.hidden_size
    return module.init(
        jax.random.key(seed),
        jnp.zeros((1, 2, len(cfg.target_layer_ids) * d), module.dtype),
        jnp.zeros((1, 2, d), module.dtype),
        jnp.zeros((1, 2), jnp.int32),
        method=DartDrafter.init_all,
    )


@struct.dataclass
class DartParams:
    """What DART's proposer reads besides its static settings.

    Attributes:
      drafter: the drafter's parameters {"params": ...}.
      embed: [V, D] the target's embedding table (shared, not copied).
      ngram: the beam's n-gram priors, longest order first (empty: no n-gram term).
    """

    drafter: dict
    embed: jax.Array
    ngram: tuple[NgramPrior, ...] = ()


@struct.dataclass
class DartState:
    """The drafter's loop state.

    Attributes:
      cache: one layer's K/V of committed positions whose next token is known, slot = position + 1
        (slot 0 is never read); `lengths` = the target cache's length (slots [1, lengths) are valid).
      pending: [B, K * D] the fused-layer target features of the newest position in the target's cache.
    """

    cache: KVCache
    pending: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class DartProposer:
    """DART as the decode loop's `Proposer` (static; parameters are passed in).

    Attributes:
      module: the drafter module.
      target: the target module (its embedding rows feed the drafter).
      draft_vocab: [V'] int32 target ids of the LM head's rows (None = the whole vocabulary, V' = V).
      depth: d used at decode time, at most the trained num_draft (None = num_draft).
      tree_budget: 0 proposes the argmax chain of the d positions; N > 0 a tree of N nodes built by DART's
        n-gram-pruned beam (dflax.drafters.dart_tree).
      beam: the beam's settings (the paper's by default).

    Its parameters (`DartParams`) carry the drafter's weights, the target's embedding table and the n-gram
    priors of the beam.
    """

    module: DartDrafter
    target: Transformer
    draft_vocab: np.ndarray | None = None
    depth: int | None = None
    tree_budget: int = 0
    beam: BeamSettings = BeamSettings()

    def __post_init__(self):
        if self.tree_budget < 0:
            raise ValueError(f"tree budget must be >= 0 (0 = a chain), got {self.tree_budget}")
        vocab = self.module.config.draft_vocab_size
        available = self.beam.num_candidates(self.num_positions, min(self.beam.top_k, vocab))
        if self.tree_budget > available:
            raise ValueError(
                f"tree budget {self.tree_budget} exceeds the {available} candidates DART's beam scores "
                f"({self.num_positions} depths, top {min(self.beam.top_k, vocab)}); "
                f"choose at most {available}"
            )

    @property
    def num_positions(self) -> int:
        """d, positions drafted by one forward."""
        return self.depth or self.module.config.num_draft

    @property
    def num_draft(self) -> int:
        """Drafts verified per step: d as a chain, or the tree budget's N nodes."""
        return self.tree_budget or self.num_positions

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the drafter fuses."""
        return self.module.config.target_layer_ids

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype) -> DartState:
        """An empty state (one slot more than the target's cache: slot = position + 1)."""
        cfg = self.module.config
        width = len(cfg.target_layer_ids) * cfg.layer.hidden_size
        return DartState(KVCache.init(cfg.layer, batch, slots + 1, dtype), jnp.zeros((batch, width), dtype))

    @staticmethod
    def embed(params: DartParams, tokens: jax.Array) -> jax.Array:
        """The target's raw embedding rows: [...] ids -> [..., D]."""
        return take_rows(params.embed, tokens)

    def observe(self, params, state: DartState, tokens, taps, positions, count) -> DartState:
        """Completes the pending position with its next token tokens[:, 0], adds tokens 0..count-2 (whose
        next tokens are known now), and keeps the features of token count-1 pending."""
        features = jnp.concatenate(taps, axis=-1)  # [B, T, K * D]
        previous = jnp.concatenate([state.pending[:, None].astype(features.dtype), features[:, :-1]], 1)
        u = self.module.apply(
            params.drafter, previous, self.embed(params, tokens), method=DartDrafter.fuse
        )  # [B, T, 2D]: position p - 1 fused with token p
        k, v = self.module.apply(params.drafter, u, positions - 1, method=DartDrafter.context_kv)
        start = positions[:, 0]  # slot of position start - 1
        cache = state.cache
        newest = jnp.take_along_axis(features, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
        return DartState(
            cache.replace(
                k=(write_kv(cache.k[0], k, start),),
                v=(write_kv(cache.v[0], v, start),),
                lengths=start + count,
            ),
            jnp.where((count > 0)[:, None], newest.astype(state.pending.dtype), state.pending),
        )

    def draft_logits(self, params, state: DartState, last_token: jax.Array) -> jax.Array:
        """One forward over [pending position + last token, MASK x (d - 1)]: [B, d, V'] logits; position j
        scores the token j + 1 places after `last_token`."""
        d = self.num_positions
        first = self.module.apply(
            params.drafter, state.pending, self.embed(params, last_token), method=DartDrafter.fuse
        )  # [B, 2D]
        mask = self.module.apply(params.drafter, method=DartDrafter.mask_vector).astype(first.dtype)
        masks = jnp.broadcast_to(mask, (first.shape[0], d - 1, mask.shape[0]))  # [B, d - 1, 2D]
        u = jnp.concatenate([first[:, None], masks], axis=1)  # [B, d, 2D]
        length = state.cache.lengths
        positions = length[:, None] - 1 + jnp.arange(d, dtype=jnp.int32)  # [B, d]
        slots = jnp.arange(state.cache.max_len)
        ctx_mask = (slots >= 1) & (slots < length[:, None])  # [B, S]
        ctx_mask = jnp.broadcast_to(ctx_mask[:, None, None], (u.shape[0], 1, d, slots.shape[0]))
        hidden = self.module.apply(
            params.drafter, u[:, None], positions[:, None], state.cache.k[0], state.cache.v[0], ctx_mask
        )[:, 0]  # [B, d, D]
        return self.module.apply(params.drafter, hidden, method=DartDrafter.logits)

    def propose(self, params, target_params, state, keys) -> tuple[jax.Array | DraftTree, None]:
        """The argmax chain of the d positions, or with a tree budget DART's beam tree (drafts are chosen
        without sampling, so the (tree) delta rule verifies them at every temperature)."""
        logits = self.draft_logits(params, state.drafter_state, state.last_token)  # [B, d, V']
        if not self.tree_budget:
            return self.token_ids(first_argmax(logits)), None
        k = min(self.beam.top_k, logits.shape[-1])
        top_logits, top_index = jax.lax.top_k(logits, k)  # [B, d, k]
        probs = jax.nn.softmax(top_logits, axis=-1)  # softmax over the top k, as published
        tree = dart_tree(
            probs,
            self.token_ids(top_index),
            state.last_token,
            state.eos_ids,
            params.ngram,
            self.tree_budget,
            self.beam,
        )
        return tree, None

    def token_ids(self, index: jax.Array) -> jax.Array:
        """Draft-vocabulary indices -> target token ids (the identity without a draft vocabulary)."""
        return index if self.draft_vocab is None else jnp.take(jnp.asarray(self.draft_vocab), index)
