"""A small masked diffusion drafter adapted from its own target (AR-to-diffusion, as Dream was made).

No diffusion LM shares SmolLM2's tokenizer, so dflax makes one from the target itself: a few of the
target's decoder layers (copied at initialisation, then trained by `dflax.train.diffusion_objective`),
the target's final norm, and the target's embedding and LM head shared (never stored with the drafter).

Attention is block-causal. The committed prefix is causal, so the drafter keeps an exact KV cache of it
(`observe`); the block [last committed token | K window slots] at positions length .. length + K attends
to the whole prefix and bidirectionally to itself. Logits are shifted as Dream's: the hidden state at
position p - 1 predicts the token at p, so the block's position 0 (the last committed token) predicts
window slot 1 and position K - 1 predicts slot K.

The mask is an existing id of the target's vocabulary that its data never uses (for SmolLM2 a special
token of its code-pretraining set), so windows stay arrays of the target's ids; its INPUT embedding is a
vector learned by the drafter (the shared table is frozen), and the drafter never drafts it (its logit is
NEG_INF).

Glossary: B batch, T tokens, S cache slots, K window slots, L drafter layers, D width, V vocabulary,
N sequences and M windows per sequence (training).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflax.decoding.sampling import NEG_INF
from dflax.models.cache import KVCache
from dflax.models.config import ModelConfig
from dflax.models.layers import RMSNorm
from dflax.models.transformer import DecoderLayer
from dflax.sharding.embedding import take_rows

# Target architectures whose decoder layers the drafter copies as they are (no embedding scale, no caps).
ADAPTABLE_ARCHS = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class AdaptedConfig:
    """The adapted drafter's architecture, tied to its target's.

    Attributes:
      layers: the drafter's L decoder layers (the target's layer kind and shapes, L layers).
      source_layers: the target layer each drafter layer was initialised from (recorded, not used at run
        time).
      mask_token_id: the target id that marks a slot still to be filled.
      window: K, the window the drafter was trained with (others run, these are what it learned).
    """

    layers: ModelConfig
    source_layers: tuple[int, ...]
    mask_token_id: int
    window: int

    @classmethod
    def for_target(
        cls, target: ModelConfig, source_layers: tuple[int, ...], mask_token_id: int, window: int
    ) -> AdaptedConfig:
        """The drafter made of `source_layers` of `target` (raises ValueError with the fix on a misfit)."""
        if target.arch not in ADAPTABLE_ARCHS or target.final_logit_softcapping:
            raise ValueError(
                f"an adapted diffusion drafter copies plain decoder layers; a {target.arch!r} target is not "
                f"supported (supported: {', '.join(ADAPTABLE_ARCHS)})"
            )
        bad = [i for i in source_layers if not 0 <= i < target.num_layers]
        if not source_layers or bad:
            raise ValueError(
                f"source_layers {list(source_layers)} must name layers of the target's {target.num_layers}"
            )
        if not 0 <= mask_token_id < target.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the target's vocabulary")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        types = tuple(target.layer_types[i] for i in source_layers)
        layers = dataclasses.replace(
            target, num_layers=len(source_layers), layer_types=types, bos_token_id=None, eos_token_ids=()
        )
        return cls(layers, tuple(int(i) for i in source_layers), int(mask_token_id), int(window))

    def check_target(self, target: ModelConfig) -> None:
        """Raises ValueError with the fix when this drafter cannot run with `target` (shared embedding)."""
        mine, theirs = self.layers, target
        fields = ("arch", "vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim")
        problems = [f"{f} {getattr(mine, f)} != target's {getattr(theirs, f)}" for f in fields
                    if getattr(mine, f) != getattr(theirs, f)]  # fmt: skip
        if problems:
            raise ValueError(
                "this diffusion drafter was not adapted from this target: "
                + "; ".join(problems)
                + ". Use the drafter made for this target (`dflax train --config "
                "configs/train/diffusion-smollm2.json` makes one)."
            )


class AdaptedLayers(nn.Module):
    """The drafter's own parameters: layers_N (target layout), norm, mask_embedding [D]."""

    config: AdaptedConfig
    dtype: jnp.dtype = jnp.float32
    attention_backend: str = "auto"

    def setup(self):
        cfg = self.config.layers
        self.layers = [
            DecoderLayer(cfg, i, self.dtype, self.attention_backend) for i in range(cfg.num_layers)
        ]
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        self.mask_embedding = self.param(
            "mask_embedding", nn.initializers.normal(0.02), (cfg.hidden_size,), self.dtype
        )

    def embed(self, embedding: jax.Array, tokens: jax.Array) -> jax.Array:
        """[..., T] ids -> [..., T, D]: the shared table's rows, the learned vector at mask slots."""
        x = take_rows(embedding, tokens).astype(self.dtype)
        return jnp.where((tokens == self.config.mask_token_id)[..., None], self.mask_embedding, x)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        new_mask: jax.Array,
        write_cache: bool = False,
        empty_cache: bool = False,
        causal: bool = False,
    ) -> tuple[jax.Array, KVCache]:
        """New tokens x [B, T, D] at positions [B, T] against the cache -> (hidden [B, T, D] after the final
        norm, the cache with their K/V written at slots [lengths, lengths + T) when `write_cache`; lengths
        unchanged). new_mask [B, T, T]: which new tokens each sees; `causal`: it is lower-triangular."""
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(
                x, positions, cache.k[i], cache.v[i], cache.lengths, new_mask,
                write_cache=write_cache, empty_cache=empty_cache, causal=causal,
            )  # fmt: skip
            ks.append(k)
            vs.append(v)
        return self.norm(x), cache.replace(k=tuple(ks), v=tuple(vs))

    def anchored_blocks(self, x, positions, context_k, context_v, context_len, chunk: int) -> jax.Array:
        """M blocks per sequence in one forward (training): x [N, M, T, D], positions [N, M, T]; block m sees
        context slots [0, context_len [N, M]) of its sequence's per-layer K/V [N, S, K, H] and itself.
        Returns [N, M, T, D] after the final norm."""
        for i, layer in enumerate(self.layers):
            x = layer.anchored_blocks(x, positions, context_k[i], context_v[i], context_len, chunk)
        return self.norm(x)


def init_adapted_params(module: AdaptedLayers, seed: int = 0) -> dict:
    """Random parameters {"params": ...} of the drafter's own part."""
    cfg = module.config.layers
    cache = KVCache.init(cfg, 1, 4, module.dtype)
    x = jnp.zeros((1, 2, cfg.hidden_size), module.dtype)
    return module.init(
        jax.random.key(seed), x, jnp.zeros((1, 2), jnp.int32), cache, jnp.ones((1, 2, 2), bool)
    )


def shared_params(target_config: ModelConfig, target_params: dict) -> dict:
    """The target's tensors the drafter shares: {"embedding": [V, D], "readout": [V, D]} (the same array
    for a tied LM head)."""
    source = target_params["params"]
    embedding = source["embed_tokens"]["weight"]
    readout = embedding if target_config.tie_word_embeddings else source["lm_head"]["weight"]
    return {"embedding": embedding, "readout": readout}


@dataclasses.dataclass(frozen=True, eq=False)
class AdaptedDrafter:
    """The adapted drafter as a `dflax.diffusion.protocol.DiffusionLM`.

    Its parameters are {"drafter": {"params": ...} (its own), "embedding": [V, D], "readout": [V, D]}
    (the target's, shared; see `shared_params`). Its state is a `KVCache` of its L layers.

    Attributes:
      module: the drafter's own layers.
      mask_token_id: the mask id.
      vocab_size: V.
    """

    module: AdaptedLayers

    @property
    def mask_token_id(self) -> int:
        """The id of a slot still to be filled."""
        return self.module.config.mask_token_id

    @property
    def vocab_size(self) -> int:
        """V, the width of the logits (the target's vocabulary)."""
        return self.module.config.layers.vocab_size

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype) -> KVCache:
        """An empty KV cache of `slots` slots per row; slots must cover the longest committed prefix plus
        the widest `observe` (its padding entries are written past the prefix too)."""
        return KVCache.init(self.module.config.layers, batch, slots, dtype)

    def observe(self, params, state: KVCache, tokens, positions, count) -> KVCache:
        """Commits the first `count` [B] of tokens [B, T] at positions [B, T]: their K/V (causal over the
        prefix and each other) go to slots [lengths, lengths + T) and lengths grows by count; entries past
        count are written past the new length, where nothing reads them."""
        t = tokens.shape[1]
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.bool_)), (tokens.shape[0], t, t))
        x = self.module.apply(params["drafter"], params["embedding"], tokens, method=AdaptedLayers.embed)
        _, cache = self.module.apply(
            params["drafter"], x, positions, state, causal, write_cache=True, causal=True
        )
        return cache.replace(lengths=state.lengths + count.astype(jnp.int32))

    def block_hidden(self, params, state: KVCache, last_token, length, window) -> jax.Array:
        """Hidden states [B, K + 1, D] of the block [last_token | window] at positions length .. length + K
        (bidirectional inside the block, which sees the state's prefix)."""
        tokens = jnp.concatenate([last_token[:, None], window], axis=1)  # [B, K + 1]
        b, t = tokens.shape
        positions = length[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)  # [B, K + 1]
        x = self.module.apply(params["drafter"], params["embedding"], tokens, method=AdaptedLayers.embed)
        hidden, _ = self.module.apply(params["drafter"], x, positions, state, jnp.ones((b, t, t), jnp.bool_))
        return hidden

    def readout(self, params, hidden: jax.Array) -> jax.Array:
        """Logits [..., V] float32 of hidden states [..., D] through the shared LM head (never the mask)."""
        logits = jnp.einsum("...d,vd->...v", hidden, params["readout"].astype(hidden.dtype)).astype(
            jnp.float32
        )
        return logits.at[..., self.mask_token_id].set(NEG_INF)

    def window_logits(self, params, state: KVCache, last_token, length, window) -> jax.Array:
        """Logits [B, K, V] of the window's slots: block position k - 1 predicts slot k (Dream's shift)."""
        hidden = self.block_hidden(params, state, last_token, length, window)  # [B, K + 1, D]
        return self.readout(params, hidden[:, :-1])
