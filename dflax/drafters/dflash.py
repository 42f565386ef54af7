"""DFlash: a block-diffusion drafter conditioned on the target's hidden features (arXiv 2602.06036).

A few decoder layers at the target's width draft a whole block in one forward pass. The block is
[last committed token, MASK x (B - 1)] at absolute positions [L, L + B); attention inside the block is
bidirectional, and every layer also attends to the context: the target's hidden states after K chosen
layers, concatenated per token, fused by fc -> RMSNorm, and projected by that layer's own k/v projections
(KV injection). The drafter keeps these projected context keys/values in its own KV cache and extends it
each step only with the newly committed tokens, whose target features come free from the verify pass.
Embedding and LM head are the target's, shared and frozen; draft token k is read at block position k,
optionally over a pruned draft vocabulary (dflax.drafters.draft_vocab).

Glossary: B batch, T tokens, D width, K fused target layers, V vocabulary, n = block_size - 1 drafts.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflax.decoding.sampling import NEG_INF, SamplingParams, categorical, first_argmax, target_log_probs
from dflax.decoding.tree import DraftTree
from dflax.drafters.best_first import best_first_tree
from dflax.models.cache import KVCache, write_kv
from dflax.models.config import ModelConfig
from dflax.models.layers import Linear, RMSNorm
from dflax.models.transformer import DecoderLayer, Transformer
from dflax.sharding.embedding import take_rows


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's taps for a drafter of `num_draft_layers` layers (dflash's `build_target_layer_ids`).

    One draft layer taps the middle layer N // 2; L > 1 layers tap round(1 + i * (N - 4) / (L - 1)) for
    i < L (Python's round, halves to even: 30 layers, 5 taps -> 1, 8, 14, 20, 27). On targets of under 4
    layers the spread reaches down to -1, the embedding output (HF hidden_states[0]), as the reference's does.
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


# Decoder-layer kinds a drafter can have: Qwen3 (q/k-norm, the official layout) and Llama (no q/k-norm).
DRAFTER_LAYER_ARCHS = ("qwen3", "llama")


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter's architecture, tied to its target's.

    Attributes:
      layers: the drafter's decoder layers at the target's width, heads, FFN: Qwen3-style (q/k-norm, the
        official layout) or Llama-style (no q/k-norm), see DRAFTER_LAYER_ARCHS.
      block_size: B, tokens per drafted block (the anchor + B - 1 drafts) it was trained for.
      target_layer_ids: target layers whose outputs are fused (HF hidden_states[l + 1]; -1 is the
        embedding output).
      mask_token_id: a target token id used as the mask (official Qwen3 drafters); None = a learned
        mask embedding owned by the drafter.
      feature_norm: RMS-normalize each tapped layer's features before `fc` (a dflax option, off in
        official drafters). Targets like SmolLM2 carry a few huge activation dimensions (about half of
        each feature's squared norm in its top 3 of 576 dims; norms from 70 to 25,000 across taps and
        positions), which otherwise swamp `fc` at the start of training.
    """

    layers: ModelConfig
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int | None = None
    feature_norm: bool = False

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        num_layers: int = 3,
        block_size: int = 16,
        target_layer_ids: tuple[int, ...] | None = None,
        mask_token_id: int | None = None,
        feature_norm: bool = False,
        layer_arch: str = "qwen3",
    ) -> DFlashConfig:
        """A drafter config at the target's width/heads/FFN (taps by the reference's spread for
        `num_layers` by default, see `default_target_layer_ids`).

        `layer_arch` is the kind of the drafter's decoder layers: "qwen3" (q/k-norm, the official layout)
        or "llama" (none; what a drafter copied from a Llama target's layers needs to behave as they do).
        """
        if layer_arch not in DRAFTER_LAYER_ARCHS:
            raise ValueError(
                f"drafter layers of kind {layer_arch!r} are not supported; use one of {DRAFTER_LAYER_ARCHS}"
            )
        layers = ModelConfig(
            arch=layer_arch,
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            tie_word_embeddings=False,  # the LM head is the target's; as official drafters record it
            max_position_embeddings=target.max_position_embeddings,
        )
        ids = (
            target_layer_ids
            if target_layer_ids is not None
            else default_target_layer_ids(target.num_layers, num_layers)
        )
        return cls(
            layers=layers,
            block_size=block_size,
            target_layer_ids=tuple(ids),
            mask_token_id=mask_token_id,
            feature_norm=feature_norm,
        )

    def check_target(self, target: ModelConfig) -> None:
        """Raises ValueError with the fix when this drafter cannot serve `target`."""
        problems = []
        if self.layers.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.layers.hidden_size} != target's {target.hidden_size}")
        if self.layers.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.layers.vocab_size} != target's {target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not -1 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target's vocabulary")
        if problems:
            raise ValueError(
                "this DFlash drafter was not built for this target: "
                + "; ".join(problems)
                + ". Use a drafter trained for this target (or train one with `dflax train`)."
            )


class DFlashDrafter(nn.Module):
    """The drafter's own parameters and forward (embedding and LM head come from the target).

    Parameter names mirror the official checkpoint layout: layers_N/{self_attn, mlp, input_layernorm,
    post_attention_layernorm}, fc, hidden_norm, norm, plus `mask_embedding` when no mask token id is used.
    """

    config: DFlashConfig
    dtype: jnp.dtype = jnp.float32
    attention_backend: str = "auto"

    def setup(self):
        cfg = self.config.layers
        self.layers = [
            DecoderLayer(cfg, i, self.dtype, self.attention_backend) for i in range(cfg.num_layers)
        ]
        self.fc = Linear(cfg.hidden_size, dtype=self.dtype)
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        if self.config.mask_token_id is None:
            self.mask_embedding = self.param(
                "mask_embedding", nn.initializers.normal(0.02), (cfg.hidden_size,), self.dtype
            )

    def context_kv(self, features: jax.Array, positions: jax.Array) -> tuple[tuple, tuple]:
        """Per-layer context keys/values of target features.

        Args:
          features: [B, T, K * D] concatenated target hidden states.
          positions: [B, T] their absolute positions.

        Returns:
          (keys, values): one [B, T, K_heads, H] array per drafter layer each.
        """
        if self.config.feature_norm:
            b, t, _ = features.shape
            taps = features.reshape(b, t, len(self.config.target_layer_ids), -1).astype(jnp.float32)
            taps = taps * jax.lax.rsqrt(jnp.mean(taps**2, axis=-1, keepdims=True) + 1e-6)  # [B, T, K, D]
            features = taps.reshape(b, t, -1).astype(features.dtype)
        context = self.hidden_norm(self.fc(features))  # [B, T, D]
        kv = [layer.self_attn.project_kv(context, positions) for layer in self.layers]
        return tuple(k for k, _ in kv), tuple(v for _, v in kv)

    def __call__(self, block: jax.Array, positions: jax.Array, context: KVCache) -> jax.Array:
        """Drafts one block.

        Args:
          block: [B, T, D] input embeddings of [anchor, MASK x (T - 1)].
          positions: [B, T] absolute positions.
          context: per-layer context K/V with valid lengths.

        Returns:
          [B, T, D] final hidden states (read at positions 1..T-1 through the target's LM head).
        """
        b, t, _ = block.shape
        visible = jnp.ones((b, t, t), jnp.bool_)  # bidirectional inside the block
        x = block
        for i, layer in enumerate(self.layers):
            x, _, _ = layer(x, positions, context.k[i], context.v[i], context.lengths, visible)
        return self.norm(x)

    def anchored_blocks(
        self, blocks: jax.Array, positions: jax.Array, context_k, context_v, context_len, chunk: int
    ) -> jax.Array:
        """Drafts M blocks per sequence in one forward, each seeing only its own context prefix (training).

        The same layers and math as `__call__` with one context per sequence instead of one per block:
        block m of row r attends to the context slots [0, context_len[r, m]) and to its own tokens, never
        to another block (`dflax.models.block_attention`).

        Args:
          blocks: [N, M, T, D] input embeddings of [anchor, MASK x (T - 1)] per block.
          positions: [N, M, T] absolute positions.
          context_k, context_v: per drafter layer, [N, S, K, H] context keys/values (`context_kv`).
          context_len: [N, M] int32, each block's anchor position.
          chunk: blocks scored at once by the attention.

        Returns:
          [N, M, T, D] final hidden states.
        """
        x = blocks
        for i, layer in enumerate(self.layers):
            x = layer.anchored_blocks(x, positions, context_k[i], context_v[i], context_len, chunk)
        return self.norm(x)

    def mask_vector(self) -> jax.Array:
        """The learned mask embedding [D]."""
        return self.mask_embedding

    def init_all(self, block, positions, context, features):
        """Touches every parameter (for `init`)."""
        self.context_kv(features, positions)
        return self(block, positions, context)


# q's temperature relative to the target's for sampled drafts. Under token-by-token speculative sampling
# a sharper q kept a little more (stage 5 drafter, HumanEval 40, target T=1, B=4, 2026-11-26: tau 1.53
# at 0.7, 1.50 at 1.0). Under block verification q at the target's own temperature keeps the most: stage
# 6 drafter, the same prompts (2026-11-28), tau 1.59 / 1.62 / 1.69 at 0.7 / 0.85 / 1.0, against 1.61 /
# 1.63 at 0.7 / 1.0 token by token; a flatter q keeps less (fp32 target on the EPYC: 1.67 / 1.63 / 1.48 at
# 1.0 / 1.3 / 1.6).
DRAFT_TEMPERATURE_SCALE = 1.0
# `--draft-sampling` values (see `DraftSampling.for_target`).
DRAFT_SAMPLING_MODES = ("auto", "greedy", "sample")


@dataclasses.dataclass(frozen=True)
class DraftSampling:
    """How drafts are chosen: "greedy" (argmax, verified by the delta rule at any temperature) or
    "sample" (drawn from the drafter's q at `temperature`, kept or not by block verification)."""

    mode: str = "greedy"
    temperature: float = 1.0

    def __post_init__(self):
        if self.mode not in ("greedy", "sample"):
            raise ValueError(f"draft sampling mode {self.mode!r} unknown; use 'greedy' or 'sample'")
        if self.mode == "sample" and self.temperature <= 0:
            raise ValueError("draft sampling 'sample' needs a positive drafter temperature")

    @classmethod
    def for_target(cls, mode: str, temperature: float, tree: bool = False) -> DraftSampling:
        """The draft sampling that `--draft-sampling MODE` means for a target sampled at `temperature`.

        "greedy": argmax drafts. "sample": drafts drawn from q at DRAFT_TEMPERATURE_SCALE x the target's
        temperature (q at 1.0 when the target is greedy). "auto" (the command line's default): greedy
        at temperature 0 and for draft trees (which need argmax drafts), "sample" otherwise.

        Raises:
          ValueError: for an unknown mode.
        """
        if mode not in DRAFT_SAMPLING_MODES:
            raise ValueError(f"draft sampling mode {mode!r} unknown; use 'auto', 'greedy' or 'sample'")
        if mode == "greedy" or (mode == "auto" and (temperature <= 0 or tree)):
            return cls("greedy")
        return cls("sample", DRAFT_TEMPERATURE_SCALE * temperature if temperature > 0 else 1.0)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashProposer:
    """The DFlash drafter as the decode loop's `Proposer` (static; parameters are passed in).

    Attributes:
      module: the drafter module.
      target: the target module whose embedding and LM head the drafter shares.
      block_size: B used at decode time (<= the trained block size works; 8 and 16 are typical).
      draft_sampling: greedy drafts (delta rule) or sampled drafts (block verification).
      draft_vocab: [V'] int32 target token ids the drafter reads out (see dflax.drafters.draft_vocab);
        None = the whole vocabulary.
      tree_budget: 0 proposes the block's argmax chain; N > 0 proposes a best-first tree of N nodes over
        the block's per-position distributions (dflax.drafters.best_first), greedy drafts only.
    """

    module: DFlashDrafter
    target: Transformer
    block_size: int
    draft_sampling: DraftSampling = DraftSampling()
    draft_vocab: np.ndarray | None = None
    tree_budget: int = 0

    def __post_init__(self):
        if self.tree_budget < 0:
            raise ValueError(f"tree budget must be >= 0 (0 = a chain), got {self.tree_budget}")
        if self.tree_budget and self.draft_sampling.mode != "greedy":
            raise ValueError(
                "draft trees are verified by the tree delta rule, which needs drafts chosen without "
                "sampling: use draft sampling 'greedy' with a tree budget, or tree budget 0 (a chain) "
                "with sampled drafts"
            )

    @property
    def block_drafts(self) -> int:
        """block_size - 1 positions drafted by one drafter forward."""
        return self.block_size - 1

    @property
    def num_draft(self) -> int:
        """Drafts verified per step: block_size - 1 as a chain, or the tree budget's N nodes."""
        return self.tree_budget or self.block_drafts

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
        ks, vs = self.module.apply(params, features, positions, method=DFlashDrafter.context_kv)
        start = drafter_state.lengths
        return drafter_state.replace(
            k=tuple(write_kv(buf, k, start) for buf, k in zip(drafter_state.k, ks)),
            v=tuple(write_kv(buf, v, start) for buf, v in zip(drafter_state.v, vs)),
            lengths=start + count,
        )

    def block_inputs(self, params, target_params, last_token: jax.Array) -> jax.Array:
        """The drafter's input block [anchor, MASK x n]: [R] token ids -> [R, n + 1, D] embeddings.

        The anchor is the target's raw (unscaled) embedding row; the mask is the target's row of
        `mask_token_id` or, without one, the drafter's learned mask embedding.
        """
        config = self.module.config
        embedding = target_params["params"]["embed_tokens"]["weight"]  # [V, D]
        anchor = take_rows(embedding, last_token)[:, None]  # [R, 1, D]
        if config.mask_token_id is None:
            mask = self.module.apply(params, method=DFlashDrafter.mask_vector).astype(anchor.dtype)
        else:
            mask = embedding[config.mask_token_id]
        masks = jnp.broadcast_to(mask, (anchor.shape[0], self.block_drafts, anchor.shape[-1]))  # [R, n, D]
        return jnp.concatenate([anchor, masks], axis=1)

    def draft_hidden(
        self, params, target_params, last_token: jax.Array, start: jax.Array, context: KVCache
    ) -> jax.Array:
        """The drafter forward shared by decoding and training: one block per row.

        Args:
          params: the drafter's parameters.
          target_params: the target's parameters (embedding rows for the block).
          last_token: [R] the anchor (last committed) token of each row.
          start: [R] int32 the anchor's absolute position; the block sits at [start, start + n + 1).
          context: per-layer context K/V whose `lengths` (= start when drafting) bound what rows see.

        Returns:
          [R, n + 1, D] final hidden states; position k (1..n) predicts the token at start + k.
        """
        block = self.block_inputs(params, target_params, last_token)  # [R, n + 1, D]
        positions = start[:, None] + jnp.arange(self.block_drafts + 1, dtype=jnp.int32)  # [R, n + 1]
        return self.module.apply(params, block, positions, context)

    def propose(self, params, target_params, state, keys) -> tuple[jax.Array | DraftTree, jax.Array | None]:
        """Drafts n tokens per row from [last token, MASK x n] in one drafter forward (or, with a tree
        budget, the best-first tree over the n positions' distributions)."""
        hidden = self.draft_hidden(
            params, target_params, state.last_token, state.cache.positions, state.drafter_state
        )  # [B, n + 1, D]
        logits = self.draft_logits(target_params, hidden[:, 1:])  # [B, n, V']
        if self.tree_budget:
            top_logits, top_index = jax.lax.top_k(logits, min(self.tree_budget, logits.shape[-1]))
            log_probs = top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # [B, n, K]
            return best_first_tree(log_probs, self.token_ids(top_index), self.tree_budget), None
        if self.draft_sampling.mode == "greedy":
            return self.token_ids(first_argmax(logits)), None
        q_params = SamplingParams.make(self.draft_sampling.temperature)
        log_q = target_log_probs(logits, q_params)  # [B, n, V']
        drafts = self.token_ids(categorical(keys, log_q))
        if self.draft_vocab is not None:  # verification reads q over the whole vocabulary: 0 outside
            full = jnp.full(log_q.shape[:-1] + (self.target.config.vocab_size,), NEG_INF, log_q.dtype)
            log_q = full.at[..., jnp.asarray(self.draft_vocab)].set(log_q)  # [B, n, V]
        return drafts, log_q

    def draft_logits(self, target_params, hidden: jax.Array) -> jax.Array:
        """The read-out through the target's LM head: [..., D] -> [..., V'] float32 logits over the draft
        vocabulary (all V tokens without one)."""
        ids = None if self.draft_vocab is None else jnp.asarray(self.draft_vocab)
        return self.target.apply(target_params, hidden, ids, method=Transformer.logits)

    def token_ids(self, index: jax.Array) -> jax.Array:
        """Draft-vocabulary indices -> target token ids (the identity without a draft vocabulary)."""
        return index if self.draft_vocab is None else jnp.take(jnp.asarray(self.draft_vocab), index)


def init_drafter_params(module: DFlashDrafter, seed: int = 0) -> dict:
    """Random parameters for a drafter (an untrained drafter: tau near 1)."""
    cfg = module.config.layers
    k = len(module.config.target_layer_ids)
    context = KVCache.init(cfg, 1, 4, module.dtype)
    return module.init(
        jax.random.key(seed),
        jnp.zeros((1, 2, cfg.hidden_size), module.dtype),
        jnp.zeros((1, 2), jnp.int32),
        context,
        jnp.zeros((1, 2, k * cfg.hidden_size), module.dtype),
        method=DFlashDrafter.init_all,
    )
