"""Decoder-only target transformer (llama family and Gemma 3) as a Flax Linen module.

Parameter paths mirror HF checkpoint names (`layers_3/self_attn/q_proj/weight` <-> `model.layers.3.self_attn.
q_proj.weight`), so loading is a name map. The forward returns the final hidden states (logits are computed
only where needed, by `logits`) and, on request, the hidden states after chosen layers for drafters.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflax.models.attention import Attention, AttentionConfig
from dflax.models.cache import KVCache, SharedPrefix
from dflax.models.config import ModelConfig
from dflax.models.layers import GatedMLP, Linear, RMSNorm, dot_float32
from dflax.models.packing import Packing
from dflax.sharding.embedding import take_rows
from pallas_kernels import bits_slicing


def attention_config(config: ModelConfig, layer_idx: int, backend: str = "auto") -> AttentionConfig:
    """The attention settings of one layer (local layers get the window and the local RoPE base)."""
    sliding = config.layer_types[layer_idx] == "sliding_attention"
    return AttentionConfig(
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        scale=config.attn_scale,
        rope_theta=config.local_rope_theta if sliding else config.rope_theta,
        rope_scaling=None if sliding else config.rope_scaling,
        qkv_bias=config.qkv_bias,
        o_bias=config.o_proj_bias,
        qk_norm=config.qk_norm,
        norm_eps=config.rms_norm_eps,
        gemma_norm=config.is_gemma,
        sliding_window=config.sliding_window if sliding else None,
        backend=backend,
    )


class Embedding(nn.Module):
    """Token embedding table `weight` [V, D]."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.weight = self.param(
            "weight", nn.initializers.normal(0.02), (self.num_embeddings, self.features), self.dtype
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """[B, T] int -> [B, T, D] (per vocabulary shard under a mesh, see dflax.sharding.embedding)."""
        return take_rows(self.weight, tokens)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied read-out: [..., D] -> float32 [..., V]."""
        return dot_float32(x, self.weight)


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP; Gemma adds post-attention and post-FFN norms."""

    config: ModelConfig
    layer_idx: int
    dtype: jnp.dtype = jnp.float32
    attention_backend: str = "auto"

    def setup(self):
        cfg = self.config

        def norm():
            return RMSNorm(cfg.rms_norm_eps, cfg.is_gemma, self.dtype)

        self.self_attn = Attention(attention_config(cfg, self.layer_idx, self.attention_backend), self.dtype)
        self.mlp = GatedMLP(cfg.intermediate_size, cfg.hidden_act, self.dtype)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if cfg.is_gemma:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def __call__(
        self,
        x,
        positions,
        k_cache,
        v_cache,
        cache_len,
        new_mask,
        write_cache: bool = False,
        empty_cache: bool = False,
        causal: bool = False,
        packing: Packing | None = None,
        shared: SharedPrefix | None = None,
    ):
        """x [B, T, D] or packed [1, L, D] -> (x, k_cache, v_cache [B, K, S, H]); see `Attention`."""
        h, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x),
            positions,
            k_cache,
            v_cache,
            cache_len,
            new_mask,
            write_cache=write_cache,
            empty_cache=empty_cache,
            causal=causal,
            packing=packing,
            shared=shared,
        )
        return self._residual(x, h), k_cache, v_cache

    def anchored_blocks(self, x, positions, k_context, v_context, context_len, chunk: int):
        """x [N, M, T, D] -> [N, M, T, D]: M blocks per row, each seeing a prefix of the row's context and
        itself only (see `Attention.anchored_blocks`)."""
        h = self.self_attn.anchored_blocks(
            self.input_layernorm(x), positions, k_context, v_context, context_len, chunk
        )
        return self._residual(x, h)

    def _residual(self, x, h):
        """The layer's output from its input x and its attention output h."""
        if self.config.is_gemma:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """A decoder-only language model over a static KV cache.

    Attributes:
      config: architecture.
      dtype: parameter and activation dtype (float32 on CPU, bfloat16 on TPU/GPU).
      attention_backend: see `dflax.models.attention.AttentionConfig.backend`.
    """

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    attention_backend: str = "auto"

    def setup(self):
        cfg = self.config
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, self.dtype)
        self.layers = [
            DecoderLayer(cfg, i, self.dtype, self.attention_backend) for i in range(cfg.num_layers)
        ]
        self.norm = RMSNorm(cfg.rms_norm_eps, cfg.is_gemma, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, dtype=self.dtype)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Input embeddings [B, T] -> [B, T, D] (scaled by sqrt(D) for Gemma)."""
        x = self.embed_tokens(tokens)
        if self.config.is_gemma:
            x = x * jnp.asarray(self.config.hidden_size**0.5, self.dtype)
        return x

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        new_mask: jax.Array | None,
        tap_layers: tuple[int, ...] = (),
        empty_cache: bool = False,
        packing: Packing | None = None,
    ) -> tuple[jax.Array, KVCache, tuple[jax.Array, ...]]:
        """Runs new tokens against the cache.

        Args:
          tokens: [B, T] int32 new tokens.
          positions: [B, T] int32 their absolute positions.
          cache: the KV cache; the new tokens' K/V are written at slots [lengths, lengths + T).
            `lengths` is NOT advanced: committing is the caller's decision. With `cache.shared`, every
            row also attends to its group's shared prefix (read once per group, see
            pallas_kernels.shared_prefix).
          new_mask: [B, T, T] bool, which new tokens each new token sees; lower-triangular (a tree in
            topological order), which lets the CPU attention skip work. None = causal by index (prompts
            and chains: token i sees new tokens j <= i), which the Pallas kernels compute from iotas
            (and skip the tiles above the diagonal) instead of reading a mask; padding tokens after a
            row's prompt then see each other, but no real token sees them.
          tap_layers: layer ids whose OUTPUT hidden states to return (HF hidden_states[l + 1]; -1 is the
            embedding output).
          empty_cache: static promise that every row's cache length is 0 (prefill): attention then
            skips the cache instead of scoring and masking all of its slots.
          packing: run the token-wise parts (embedding, projections, MLP, norms) on the real tokens only,
            packed back to back (see dflax.models.packing); attention still sees [B, T].

        Returns:
          (hidden [B, T, D] after the final norm, updated cache, taps: one [B, T, D] per tap layer);
          with `packing`, hidden and taps are packed: [1, L, D].
        """
        if packing is not None and not empty_cache:
            raise ValueError("packed tokens are for prompts: pass empty_cache=True with packing")
        x = self.embed(tokens if packing is None else packing.pack(tokens)[None])  # [B, T, D] or [1, L, D]
        ks, vs, taps = [], [], {-1: x}  # tap -1: the embedding output (HF hidden_states[0])
        for i, layer in enumerate(self.layers):
            x, k_cache, v_cache = layer(
                x,
                positions,
                cache.k[i],
                cache.v[i],
                cache.lengths,
                new_mask,
                write_cache=True,
                empty_cache=empty_cache,
                causal=True,
                packing=packing,
                shared=None if cache.shared is None else cache.shared.layer(i),
            )
            ks.append(k_cache)
            vs.append(v_cache)
            if i in tap_layers:
                taps[i] = x
        cache = cache.replace(k=tuple(ks), v=tuple(vs))
        return self.norm(x), cache, tuple(taps[i] for i in tap_layers)

    def logits(self, hidden: jax.Array, vocab_ids: jax.Array | None = None) -> jax.Array:
        """Read-out [..., D] -> float32 logits [..., V] (with Gemma's final soft cap if configured).

        With `vocab_ids` [V'] only those tokens are read out: [..., V'] logits equal to the full logits at
        vocab_ids, at V' / V of the cost (a drafter's pruned vocabulary).
        """
        tied = self.config.tie_word_embeddings
        if vocab_ids is not None:
            weight = (
                self.embed_tokens.weight if tied else self.lm_head.variables["params"]["weight"]
            )  # [V, D]
            out = dot_float32(hidden, bits_slicing.take(weight, vocab_ids, axis=0))
        elif tied:
            out = self.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        out = out.astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        if cap:
            out = jnp.tanh(out / cap) * cap
        return out
