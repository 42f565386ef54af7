"""DFlash 2: a DFlash drafter whose block positions talk to each other (DFlash 2, "Keep Drafting Parallel",
z-lab 2026).

The drafter is DFlash's (dflax.drafters.dflash): a few Qwen3 decoder layers at the target's width draft a
whole block [anchor, MASK x n] in one forward, attending to the target's fused hidden features (KV
injection) and to the block itself. DFlash 2 adds two things and one attention rule:

- around each sublayer (attention, MLP) a grouped dynamic causal convolution along the block: `prepare`
  mixes each position with the P - 1 positions before it (a base kernel per channel plus a per-token,
  per-group kernel projected from the normalized input) before the sublayer, and `finish` does the same
  with a second kernel pair to the sublayer's output. The context features are not convolved;
- a low-rank candidate selector: at each draft position the drafter's top-M logits are rescored with
  < predecessor_codebook[previous token] * W h, successor_codebook[candidate] >, and one candidate is chosen
  position after position (argmax, or a draw from softmax(score / T)), so draft i depends on draft i - 1
  within one forward;
- the official drafters' layers are "sliding_attention" with `is_causal: false`: a key at position kp is
  visible to a query at qp only if |qp - kp| < sliding_window, over the context and the block alike (the
  window reaches into the block both ways), and the block stays bidirectional. A config without
  `is_causal` makes sliding layers causal (the reference's rule).

Glossary: B batch, T block tokens, S cache slots, D width (= G * C), G channel groups, C channels per group,
P convolution taps (conv_kernel_size), R selector rank, M selector candidates (selector_top_k), V vocabulary,
n = T - 1 drafts.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflax.decoding.sampling import first_argmax
from dflax.drafters.dflash import DFlashConfig
from dflax.models.attention import Attention
from dflax.models.cache import KVCache
from dflax.models.layers import GatedMLP, Linear, RMSNorm
from dflax.models.transformer import attention_config

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclasses.dataclass(frozen=True)
class DFlash2Config:
    """A DFlash 2 drafter's architecture.

    Attributes:
      base: the DFlash part: Qwen3 layers at the target's width, block size, taps, mask token id.
      conv_kernel_size: P, taps of each causal convolution (the official drafters: 2).
      conv_group_size: C, channels sharing one dynamic kernel weight (the official drafters: 16).
      selector_rank: R, rank of the selector's codebooks.
      selector_top_k: M, candidates rescored per draft position.
      layer_types: one "sliding_attention" or "full_attention" per drafter layer.
      sliding_window: the window of sliding layers (None when the config's use_sliding_window is off: the
        sliding layers then attend globally, as transformers' Qwen3Config makes them).
      is_causal: the config's `is_causal`: False (the official drafters) = every layer bidirectional,
        True = every layer causal, None = sliding layers causal and full layers bidirectional.
      output_multiplier: scales the draft logits.
      final_logit_softcapping: c in c * tanh(logits / c) after the multiplier; None = no cap.
      input_embedding_scale: scales the target embeddings of the block before the first layer.
    """

    base: DFlashConfig
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    is_causal: bool | None = False
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def __post_init__(self):
        layers = self.base.layers
        problems = []
        if layers.arch != "qwen3":
            problems.append(f"layers of kind {layers.arch!r} (DFlash 2 drafters have Qwen3 layers)")
        if self.base.mask_token_id is None:
            problems.append("no mask_token_id (DFlash 2 drafters mask with a target token)")
        if self.base.feature_norm:
            problems.append("feature_norm (a dflax DFlash option, not part of DFlash 2)")
        if self.conv_kernel_size < 1:
            problems.append(f"conv_kernel_size {self.conv_kernel_size} (needs >= 1)")
        if self.conv_group_size < 1 or layers.hidden_size % self.conv_group_size:
            problems.append(
                f"conv_group_size {self.conv_group_size} does not divide hidden_size {layers.hidden_size}"
            )
        if not 1 <= self.selector_top_k <= layers.vocab_size:
            problems.append(f"selector_top_k {self.selector_top_k} outside [1, {layers.vocab_size}]")
        if self.selector_rank < 1:
            problems.append(f"selector_rank {self.selector_rank} (needs >= 1)")
        if len(self.layer_types) != layers.num_layers:
            problems.append(f"{len(self.layer_types)} layer_types for {layers.num_layers} layers")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            problems.append(f"layer types {bad} (use {SLIDING!r} or {FULL!r})")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window {self.sliding_window} (needs >= 1, or None)")
        if problems:
            raise ValueError("invalid DFlash 2 drafter config: " + "; ".join(problems))

    @property
    def layers(self):
        """The drafter's decoder layers (a ModelConfig)."""
        return self.base.layers

    @property
    def block_size(self) -> int:
        """T, tokens per drafted block it was trained for."""
        return self.base.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs are fused."""
        return self.base.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        """The target token id masking the drafted positions."""
        return self.base.mask_token_id

    def layer_window(self, i: int) -> int | None:
        """Layer i's attention window (None = global)."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def layer_causal(self, i: int) -> bool:
        """Whether layer i's block attends causally (the reference's rule, see `is_causal`)."""
        return self.layer_types[i] == SLIDING if self.is_causal is None else bool(self.is_causal)


def block_visibility(length: int, window: int | None, causal: bool) -> jax.Array:
    """[T, T] bool: block token i sees block token j (|i - j| < window, and j <= i when causal).

    The block's tokens sit at consecutive positions, so index distance is position distance; the window's
    backward half also reaches the context, which the attention applies from the positions.
    """
    i = jnp.arange(length)[:, None]
    j = jnp.arange(length)[None, :]
    visible = jnp.ones((length, length), jnp.bool_)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= jnp.abs(i - j) < window
    return visible


def shift_right(x: jax.Array, offset: int) -> jax.Array:
    """[B, T, ...] -> [B, T, ...] whose position t holds x's position t - offset (zeros before the block)."""
    if offset == 0:
        return x
    pad = [(0, 0), (offset, 0)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, : x.shape[1] - offset], pad)


def grouped_dynamic_convolve(x: jax.Array, dynamic: jax.Array, base: jax.Array, group_size: int) -> jax.Array:
    """A causal convolution along the block with a per-channel base kernel plus a per-token group kernel.

    out[t, g, c] = sum_p (base[p, g * C + c] + dynamic[t, p, g]) * x[t - p, g, c], x[t - p] = 0 before t = 0:
    position t reads itself and the P - 1 positions before it, never a later one.

    Args:
      x: [B, T, D] the block's hidden states.
      dynamic: [B, T, P, G] per-token kernels (from the output position's own input).
      base: [P, D] the learned base kernel.
      group_size: C.

    Returns:
      [B, T, D] in x's dtype (computed in float32).
    """
    b, t, d = x.shape
    taps, groups = base.shape[0], d // group_size
    blocks = x.astype(jnp.float32).reshape(b, t, groups, group_size)  # [B, T, G, C]
    base = base.astype(jnp.float32).reshape(taps, groups, group_size)  # [P, G, C]
    dynamic = dynamic.astype(jnp.float32)
    out = jnp.zeros_like(blocks)
    for p in range(taps):
        kernel = base[p] + dynamic[:, :, p, :, None]  # [B, T, G, C]
        out = out + kernel * shift_right(blocks, p)
    return out.reshape(b, t, d).astype(x.dtype)


def _identity_kernel(key, shape, dtype):
    """[2, P, D] base kernels that pass the input through (tap 0 ones, the rest zeros)."""
    del key
    return jnp.zeros(shape, dtype).at[:, 0].set(1)


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: `prepare` before it, `finish` after it.

    Parameters (checkpoint names under layers.N.{attention_conv, mlp_conv}): `base_kernel` [2, P, D] (index 0
    for prepare, 1 for finish) and `kernel_projection.weight` [2 * P * G, D], which maps the sublayer's
    normalized input to both per-token kernels.
    """

    hidden_size: int
    kernel_size: int
    group_size: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        groups = self.hidden_size // self.group_size
        self.base_kernel = self.param(
            "base_kernel", _identity_kernel, (2, self.kernel_size, self.hidden_size), self.dtype
        )  # [2, P, D]
        self.kernel_projection = Linear(2 * self.kernel_size * groups, dtype=self.dtype)

    def prepare(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[B, T, D] -> (convolved [B, T, D], the finish kernels [B, T, P, G])."""
        b, t, d = x.shape
        dynamic = self.kernel_projection(x).reshape(b, t, 2, self.kernel_size, d // self.group_size)
        out = grouped_dynamic_convolve(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size)
        return out, dynamic[:, :, 1]

    def finish(self, x: jax.Array, dynamic: jax.Array) -> jax.Array:
        """The sublayer's output [B, T, D] and the kernels from `prepare` [B, T, P, G] -> [B, T, D]."""
        return grouped_dynamic_convolve(x, dynamic, self.base_kernel[1], self.group_size)


class DFlash2Layer(nn.Module):
    """A Qwen3 pre-norm decoder layer whose attention and MLP each sit between prepare and finish.

    Only the block is convolved: its queries, keys and values come from the convolved input; the context's
    keys and values come in projected (`DFlash2Drafter.context_kv`).
    """

    config: DFlash2Config
    layer_idx: int
    dtype: jnp.dtype = jnp.float32
    attention_backend: str = "auto"

    def setup(self):
        cfg = self.config
        layers = cfg.layers
        # One RoPE for every layer (the reference's): the layers' own windows come from `cfg`, not from
        # ModelConfig's layer types, which would give sliding layers a local RoPE base.
        global_layers = dataclasses.replace(layers, layer_types=(), sliding_window=None)
        attention = dataclasses.replace(
            attention_config(global_layers, self.layer_idx, self.attention_backend),
            sliding_window=cfg.layer_window(self.layer_idx),
        )
        self.self_attn = Attention(attention, self.dtype)
        self.mlp = GatedMLP(layers.intermediate_size, layers.hidden_act, self.dtype)
        self.input_layernorm = RMSNorm(layers.rms_norm_eps, dtype=self.dtype)
        self.post_attention_layernorm = RMSNorm(layers.rms_norm_eps, dtype=self.dtype)
        conv = lambda: GroupedDynamicCausalConv(  # noqa: E731
            layers.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, self.dtype
        )
        self.attention_conv = conv()
        self.mlp_conv = conv()

    def __call__(self, x, positions, k_context, v_context, context_len, visible) -> jax.Array:
        """One layer over the block.

        Args:
          x: [B, T, D] the block's hidden states.
          positions: [B, T] int32 absolute positions.
          k_context, v_context: [B, K, S, H] context keys/values (slot j = position j).
          context_len: [B] int32 valid context slots.
          visible: [B, T, T] bool, which block tokens each block token sees (`block_visibility`).

        Returns:
          [B, T, D].
        """
        h, finish = self.attention_conv.prepare(self.input_layernorm(x))
        h, _, _ = self.self_attn(h, positions, k_context, v_context, context_len, visible)
        x = x + self.attention_conv.finish(h, finish)
        h, finish = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), finish)


def inverse_cdf_draw(probs: jax.Array, uniforms: jax.Array) -> jax.Array:
    """Draws an index of each row of `probs` by inverse CDF over its entries in descending order.

    The order makes the draw a function of the distribution alone, not of how the candidates are laid out
    (top-k implementations return them in different orders): the same uniform picks the same token.

    Args:
      probs: [B, M] float32 distributions.
      uniforms: [B] float32 in [0, 1).

    Returns:
      [B] int32 indices into M.
    """
    order = jnp.argsort(-probs, axis=-1, stable=True)  # [B, M]
    cdf = jnp.cumsum(jnp.take_along_axis(probs, order, axis=-1), axis=-1)  # [B, M]
    rank = jnp.sum(cdf <= uniforms[:, None] * cdf[:, -1:], axis=-1)  # [B]
    rank = jnp.minimum(rank, probs.shape[-1] - 1)
    return jnp.take_along_axis(order, rank[:, None], axis=-1)[:, 0].astype(jnp.int32)


def chain_select(
    unary: jax.Array,
    candidates: jax.Array,
    projected: jax.Array,
    predecessor_codebook: jax.Array,
    successor_codebook: jax.Array,
    anchor_ids: jax.Array,
    temperature: jax.Array | float,
    uniforms: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Chooses one candidate per draft position, each scored against the token chosen before it.

    score[i, m] = unary[i, m] + < predecessor_codebook[token_{i-1}] * projected[i], successor_codebook[cand[i,
    m]] >, token_{-1} = the anchor. At temperature 0 the argmax; above, an inverse-CDF draw from
    softmax(score / T) with uniforms[:, i].

    Args:
      unary: [B, n, M] float32 the candidates' logits.
      candidates: [B, n, M] int32 their token ids.
      projected: [B, n, R] the hidden states through the selector's projection.
      predecessor_codebook, successor_codebook: [V, R].
      anchor_ids: [B] int32 the token before the first draft.
      temperature: scalar (traced or not); 0 = greedy.
      uniforms: [B, n] float32 in [0, 1) (read only when temperature > 0).

    Returns:
      (path [B, n] int32 token ids, q [B, n, M] float32 each position's distribution over its candidates:
      softmax(score / T), a one-hot on the argmax at temperature 0).
    """
    temperature = jnp.asarray(temperature, jnp.float32)
    successors = jnp.take(successor_codebook, candidates, axis=0).astype(jnp.float32)  # [B, n, M, R]
    time_major = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731  [B, n, ...] -> [n, B, ...]

    def step(previous, xs):
        # [B, M], [B, M], [B, R], [B, M, R], [B]
        unary_i, candidates_i, projected_i, successors_i, uniform_i = xs
        query = jnp.take(predecessor_codebook, previous, axis=0).astype(jnp.float32) * projected_i  # [B, R]
        pair = jnp.einsum("BR,BMR->BM", query, successors_i, precision=jax.lax.Precision.HIGHEST)
        score = unary_i.astype(jnp.float32) + pair  # [B, M]
        greedy = first_argmax(score)  # [B]
        probs = jax.nn.softmax(score / jnp.maximum(temperature, 1e-6), axis=-1)  # [B, M]
        sampling = temperature > 0
        index = jnp.where(sampling, inverse_cdf_draw(probs, uniform_i), greedy)
        q = jnp.where(sampling, probs, jax.nn.one_hot(greedy, score.shape[-1], dtype=jnp.float32))
        token = jnp.take_along_axis(candidates_i, index[:, None], axis=-1)[:, 0]  # [B]
        return token, (token, q)

    xs = tuple(
        time_major(a)
        for a in (unary, candidates, projected.astype(jnp.float32), successors, uniforms.astype(jnp.float32))
    )
    _, (path, q) = jax.lax.scan(step, anchor_ids.astype(candidates.dtype), xs)
    return time_major(path), time_major(q)


class CandidateSelector(nn.Module):
    """The low-rank selector: top-M logits rescored by a predecessor/successor bilinear term, chosen in order.

    Parameters (checkpoint names under candidate_selector): `predecessor_codebook` [V, R] and
    `successor_codebook` [V, R] (stored without a `.weight` suffix), `hidden_projection.weight` [R, D].
    """

    vocab_size: int
    rank: int
    top_k: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        init = nn.initializers.normal(0.02)
        shape = (self.vocab_size, self.rank)
        self.predecessor_codebook = self.param("predecessor_codebook", init, shape, self.dtype)  # [V, R]
        self.successor_codebook = self.param("successor_codebook", init, shape, self.dtype)  # [V, R]
        self.hidden_projection = Linear(self.rank, dtype=self.dtype)

    def __call__(
        self,
        hidden: jax.Array,
        logits: jax.Array,
        anchor_ids: jax.Array,
        temperature: jax.Array | float,
        uniforms: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Drafts the block's tokens one position after another.

        Args:
          hidden: [B, n, D] the drafter's final hidden states at the draft positions (block 1..n).
          logits: [B, n, V] float32 draft logits there (`scale_logits` applied).
          anchor_ids: [B] int32 the block's anchor (the predecessor of the first draft).
          temperature: scalar; 0 = greedy.
          uniforms: [B, n] float32 in [0, 1), one per draw (e.g. jax.random.uniform(key, (B, n)));
            None at temperature 0.

        Returns:
          (path [B, n] int32 drafted token ids, candidates [B, n, M] int32 token ids, q [B, n, M] float32
          each position's distribution over its candidates given the path before it).
        """
        unary, candidates = jax.lax.top_k(logits.astype(jnp.float32), self.top_k)  # [B, n, M] x 2
        if uniforms is None:
            uniforms = jnp.zeros(hidden.shape[:2], jnp.float32)
        path, q = chain_select(
            unary,
            candidates.astype(jnp.int32),
            self.hidden_projection(hidden),
            self.predecessor_codebook,
            self.successor_codebook,
            anchor_ids,
            temperature,
            uniforms,
        )
        return path, candidates.astype(jnp.int32), q


def scale_logits(config: DFlash2Config, logits: jax.Array) -> jax.Array:
    """Raw read-out logits through the target's LM head -> the drafter's logits [..., V] float32 (the
    output multiplier, then the soft cap when one is set)."""
    logits = logits.astype(jnp.float32) * config.output_multiplier
    cap = config.final_logit_softcapping
    if cap is not None and cap > 0:
        logits = jnp.tanh(logits / cap) * cap
    return logits


class DFlash2Drafter(nn.Module):
    """The DFlash 2 drafter's parameters and forward (embedding and LM head come from the target).

    Parameter names mirror the official checkpoint: layers_N/{self_attn, mlp, input_layernorm,
    post_attention_layernorm, attention_conv, mlp_conv}, fc, hidden_norm, norm, candidate_selector.
    """

    config: DFlash2Config
    dtype: jnp.dtype = jnp.float32
    attention_backend: str = "auto"

    def setup(self):
        cfg = self.config
        layers = cfg.layers
        self.layers = [
            DFlash2Layer(cfg, i, self.dtype, self.attention_backend) for i in range(layers.num_layers)
        ]
        self.fc = Linear(layers.hidden_size, dtype=self.dtype)
        self.hidden_norm = RMSNorm(layers.rms_norm_eps, dtype=self.dtype)
        self.norm = RMSNorm(layers.rms_norm_eps, dtype=self.dtype)
        self.candidate_selector = CandidateSelector(
            layers.vocab_size, cfg.selector_rank, cfg.selector_top_k, self.dtype
        )

    def context_kv(self, features: jax.Array, positions: jax.Array) -> tuple[tuple, tuple]:
        """Per-layer context keys/values of target features (unconvolved, as in DFlash).

        Args:
          features: [B, T, K * D] concatenated target hidden states.
          positions: [B, T] their absolute positions.

        Returns:
          (keys, values): one [B, T, K_heads, H] array per drafter layer each.
        """
        context = self.hidden_norm(self.fc(features))  # [B, T, D]
        kv = [layer.self_attn.project_kv(context, positions) for layer in self.layers]
        return tuple(k for k, _ in kv), tuple(v for _, v in kv)

    def __call__(self, block: jax.Array, positions: jax.Array, context: KVCache) -> jax.Array:
        """Drafts one block.

        Args:
          block: [B, T, D] the target's (unscaled) input embeddings of [anchor, MASK x (T - 1)].
          positions: [B, T] absolute positions; the context cache holds positions [0, context.lengths).
          context: per-layer context K/V with valid lengths.

        Returns:
          [B, T, D] final hidden states (position k, 1..T-1, is read out for the token at positions + k).
        """
        b, t, _ = block.shape
        x = block * jnp.asarray(self.config.input_embedding_scale, block.dtype)
        for i, layer in enumerate(self.layers):
            visible = block_visibility(t, self.config.layer_window(i), self.config.layer_causal(i))
            visible = jnp.broadcast_to(visible, (b, t, t))
            x = layer(x, positions, context.k[i], context.v[i], context.lengths, visible)
        return self.norm(x)

    def select(self, hidden, logits, anchor_ids, temperature, uniforms=None):
        """The candidate selector (see `CandidateSelector.__call__`)."""
        return self.candidate_selector(hidden, logits, anchor_ids, temperature, uniforms)

    def propose(self, hidden, raw_logits, anchor_ids, temperature, uniforms=None):
        """The drafts of a block from its draft hidden states [B, n, D] and their raw read-out [B, n, V]
        (the reference's `DFlash2DraftModel.propose`): `scale_logits`, then `select`."""
        return self.select(hidden, scale_logits(self.config, raw_logits), anchor_ids, temperature, uniforms)

    def init_all(self, block, positions, context, features, anchor_ids):
        """Touches every parameter (for `init`)."""
        self.context_kv(features, positions)
        hidden = self(block, positions, context)
        logits = jnp.zeros(hidden.shape[:2] + (self.config.layers.vocab_size,), jnp.float32)
        return self.select(hidden, logits, anchor_ids, 0.0)


def init_dflash2_params(module: DFlash2Drafter, seed: int = 0) -> dict:
    """Random parameters for a DFlash 2 drafter (identity base kernels; an untrained drafter)."""
    cfg = module.config.layers
    taps = len(module.config.target_layer_ids)
    context = KVCache.init(cfg, 1, 4, module.dtype)
    return module.init(
        jax.random.key(seed),
        jnp.zeros((1, 2, cfg.hidden_size), module.dtype),
        jnp.zeros((1, 2), jnp.int32),
        context,
        jnp.zeros((1, 2, taps * cfg.hidden_size), module.dtype),
        jnp.zeros((1,), jnp.int32),
        method=DFlash2Drafter.init_all,
    )
