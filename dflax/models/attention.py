"""Grouped-query self-attention over a static KV cache: the one attention entry point of dflax.

Every forward (prefill, decode, verify, drafting) is the same operation: n new tokens attend to a cached
prefix [0, cache_len) and to those new tokens that their mask allows (causal for prefill and chains, an
ancestor mask for trees, all-visible for a diffusion block). The math lives in `pallas_kernels.tree_attention`
(a jnp reference for CPU, Pallas kernels for TPU and GPU) and the backend is a setting, not a code path.
Drafter training adds one layout (`Attention.anchored_blocks`): many blocks share one context, each seeing
a prefix of it, the same math with a per-block cache length (`dflax.models.block_attention`).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflax.cpu_kernels.tree_attention import cpu_tree_attention, cpu_tree_attention_applies
from dflax.models.block_attention import anchored_block_attention
from dflax.models.cache import SharedPrefix, write_kv
from dflax.models.config import RopeScaling
from dflax.models.layers import Linear, RMSNorm, apply_rope, rope_inv_freq
from dflax.models.packing import Packing
from dflax.sharding.attention import shard_attention
from pallas_kernels.shared_prefix import shared_prefix_attention
from pallas_kernels.shared_prefix.packed import packed_shared_prefix_attention
from pallas_kernels.tree_attention import resolve_backend, tree_attention
from pallas_kernels.tree_attention.packed import packed_causal_attention
from pallas_kernels.tree_attention.reference import default_scale

ATTENTION_BACKENDS = (
    "reference",
    "chunked",
    "pallas",
    "pallas_tpu",
    "pallas_gpu",
    "pallas_interpret",
    "auto",
)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What one attention layer needs to know.

    Attributes:
      hidden_size: model width D (input and output of the layer).
      num_heads: query heads N.
      num_kv_heads: key/value heads K (N % K == 0).
      head_dim: H.
      scale: softmax scale of the logits.
      rope_theta: RoPE base of this layer.
      rope_scaling: optional RoPE frequency scaling.
      qkv_bias: q/k/v projections carry biases.
      o_bias: the output projection carries a bias.
      qk_norm: RMS-normalize q and k per head before RoPE (Qwen3, Gemma 3).
      norm_eps: epsilon of the q/k norms.
      gemma_norm: q/k norms use Gemma's (1 + w) scale.
      sliding_window: keys older than this many positions are invisible (None = global).
      backend: "reference" (dense jnp, the specification), "chunked" (jnp whose cost follows the filled
        cache: the CPU path), "pallas" (the Pallas kernel of the TPU/GPU this process runs on),
        "pallas_tpu" / "pallas_gpu" (that platform's kernel whatever this process runs on: compiling ahead
        of time for a TPU or GPU topology from a CPU host), "pallas_interpret" (Pallas in interpret mode:
        CPU tests), "auto" (Pallas on TPU/GPU; on the CPU `dflax.cpu_kernels.tree_attention` for decode
        and verify steps where it applies, chunked for the rest).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6
    gemma_norm: bool = False
    sliding_window: int | None = None
    backend: str = "auto"

    def __post_init__(self):
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention backend {self.backend!r} unknown; choose one of {ATTENTION_BACKENDS}"
            )


def _kernel_backend(setting: str) -> tuple[str, bool]:
    """Maps an `attention_backend` setting to the kernel's (backend, interpret) arguments."""
    if setting == "pallas_interpret":
        return "gpu", True
    if setting in ("pallas_tpu", "pallas_gpu"):
        return setting.removeprefix("pallas_"), False
    if setting == "pallas" and jax.default_backend() not in ("tpu", "gpu"):
        raise ValueError(
            "attention_backend='pallas' needs a TPU or GPU; on CPU use 'auto' (the chunked CPU path) or "
            "'pallas_interpret' (runs the kernel in interpret mode, for tests), or 'pallas_tpu' / "
            "'pallas_gpu' to compile ahead of time for that platform (see dflax.aot)"
        )
    return (setting if setting in ("reference", "chunked") else "auto"), False


def _attends_packed(cfg: AttentionConfig) -> bool:
    """Packed prompts attend in their packed layout where the CPU path runs (`packed_causal_attention`);
    the kernels take the padded layout."""
    backend, _ = _kernel_backend(cfg.backend)
    return resolve_backend(backend) == "chunked"


def attend(
    cfg: AttentionConfig,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_len: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    new_mask: jax.Array,
    q_positions: jax.Array,
    causal: bool = False,
) -> jax.Array:
    """Prefix + new-token attention through the configured backend.

    Args:
      cfg: attention settings.
      q: [B, T, N, H] queries (RoPE applied).
      k_cache, v_cache: [B, K, S, H] cached keys/values; slots >= cache_len are never read.
      cache_len: [B] int32 valid cache length per row.
      k_new, v_new: [B, T, K, H] keys/values of the new tokens.
      new_mask: [B, T, T] bool, query i may see new token j; None = causal by index (j <= i: prompts and
        chains), which the kernels compute from iotas instead of reading a mask.
      q_positions: [B, T] int32 absolute positions of the new tokens.
      causal: static promise that new_mask is lower-triangular (lets the CPU path skip work).

    Returns:
      [B, T, N, H] attention output in q's dtype.
    """
    backend, interpret = _kernel_backend(cfg.backend)

    def run(q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, q_positions):
        if backend == "auto" and resolve_backend(backend) == "chunked":
            # A 16-bit model keeps a float32 cache on the CPU (`dflax.target.default_cache_dtype`): its
            # queries and new keys and values widen exactly to the cache's dtype for the kernel.
            wide_q, wide_k, wide_v = _widened_to(k_cache.dtype, q, k_new, v_new)
            if cpu_tree_attention_applies(wide_q, k_cache, wide_k, cfg.sliding_window, None):
                # a decode or verify step on the CPU: one kernel call, not a loop of small products
                scale = default_scale(q.shape[-1], cfg.scale)
                out = cpu_tree_attention(wide_q, k_cache, v_cache, cache_len, wide_k, wide_v, new_mask, scale)
                return out.astype(q.dtype)
        return tree_attention(
            q,
            k_cache,
            v_cache,
            cache_len,
            k_new,
            v_new,
            new_mask,
            sm_scale=cfg.scale,
            sliding_window=cfg.sliding_window,
            q_positions=q_positions,
            backend=backend,
            interpret=interpret,
            causal=causal,
        )

    # Under a (data, model) mesh each device attends its own rows and heads; otherwise `run` itself.
    run = shard_attention(run, cfg.num_heads, cfg.num_kv_heads)
    return run(q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, q_positions)


def _widened_to(cache_dtype, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """The 16-bit `arrays` as a float32 cache's dtype (exact), the others as they are."""
    if cache_dtype != jnp.float32:
        return arrays
    return tuple(a.astype(cache_dtype) if a.dtype in (jnp.bfloat16, jnp.float16) else a for a in arrays)


def _pallas_platform(backend: str) -> str | None:
    """The Pallas platform ("tpu" or "gpu") a kernel backend resolves to, else None (the jnp path)."""
    resolved = resolve_backend(backend)
    return resolved if resolved in ("tpu", "gpu") else None


def _check_global(cfg: AttentionConfig) -> None:
    """Shared prefixes are read by global-attention layers only."""
    if cfg.sliding_window is not None:
        raise ValueError(
            "a shared prefix is read by global-attention layers only; this layer has a sliding window "
            "(use shared_prefix='none' for this model)"
        )


def _attend_shared(cfg, shared, q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, causal):
    """Shared prefix + own cache + new-token attention: [B, T, N, H] (see `Attention.__call__`)."""
    _check_global(cfg)
    backend, interpret = _kernel_backend(cfg.backend)
    return shared_prefix_attention(
        q, shared.k[0], shared.v[0], shared.lengths, shared.layout, k_cache, v_cache, cache_len, k_new, v_new,
        new_mask, sm_scale=cfg.scale, causal=causal,
        prefix_kernel="gpu" if interpret else _pallas_platform(backend), interpret=interpret,
    )  # fmt: skip


def _attend_packed_shared(cfg, shared, packing, q, k, v):
    """Packed prompt rests q [L, N, H], k, v [L, K, H] over their groups' shared prefixes and causally
    over their own rows: [1, L, N * H] (see pallas_kernels.shared_prefix.packed)."""
    _check_global(cfg)
    rows = packing.segment_ids
    token_group = jnp.where(rows >= 0, shared.layout.row_group[jnp.maximum(rows, 0)], -1)  # [L]
    out = packed_shared_prefix_attention(
        q, k, v, rows, token_group, shared.k[0], shared.v[0], shared.lengths, sm_scale=cfg.scale
    )
    return out.reshape(1, packing.size, -1)


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional q/k-norm and biases, reading a static KV cache.

    With `write_cache` the layer writes the new tokens' keys and values at each row's cache length BEFORE
    attending, and attends to the written buffers: the write then has no reader of the old buffer to wait
    for, so XLA updates the (donated) cache in place instead of copying it every layer and step. Slots
    from the cache length on are still never read; the new tokens are attended from k_new/v_new.
    """

    cfg: AttentionConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.cfg
        self.q_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.qkv_bias, self.dtype)
        self.k_proj = Linear(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, self.dtype)
        self.v_proj = Linear(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, self.dtype)
        self.o_proj = Linear(cfg.hidden_size, cfg.o_bias, self.dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.norm_eps, cfg.gemma_norm, self.dtype)
            self.k_norm = RMSNorm(cfg.norm_eps, cfg.gemma_norm, self.dtype)

    def _inv_freq(self):
        return rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys (normalized, rotated) and values of x: [B, T, D] -> ([B, T, K, H], [B, T, K, H])."""
        cfg = self.cfg
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions, self._inv_freq()), v

    def project_qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys (normalized, rotated) and values of x [B, T, D]: ([B, T, N, H], [B, T, K, H] x 2)."""
        cfg = self.cfg
        q = self.q_proj(x).reshape(*x.shape[:2], cfg.num_heads, cfg.head_dim)  # [B, T, N, H]
        if cfg.qk_norm:
            q = self.q_norm(q)
        k, v = self.project_kv(x, positions)
        return apply_rope(q, positions, self._inv_freq()), k, v

    def anchored_blocks(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_context: jax.Array,
        v_context: jax.Array,
        context_len: jax.Array,
        chunk: int,
    ) -> jax.Array:
        """M blocks per row, each attending to a prefix of the row's context and to itself only (training).

        Args:
          x: [N, M, T, D] normalized hidden states of M blocks of T tokens per row.
          positions: [N, M, T] int32 absolute positions.
          k_context, v_context: [N, S, K, H] the row's context keys/values (shared by its blocks).
          context_len: [N, M] int32; block m sees context slots [0, context_len[:, m]).
          chunk: blocks scored at once (see `dflax.models.block_attention`).

        Returns:
          [N, M, T, D].
        """
        cfg = self.cfg
        if cfg.sliding_window is not None:
            raise ValueError("anchored blocks take global-attention layers; this layer has a sliding window")
        n, m, t, _ = x.shape
        q, k, v = self.project_qkv(x.reshape(n, m * t, -1), positions.reshape(n, m * t))
        per_block = lambda a: a.reshape(n, m, t, *a.shape[2:])  # noqa: E731  [N, M * T, ...] -> [N, M, T, ...]
        out = anchored_block_attention(
            per_block(q), k_context, v_context, context_len,
            per_block(k.astype(k_context.dtype)), per_block(v.astype(v_context.dtype)),
            sm_scale=cfg.scale, chunk=chunk,
        )  # fmt: skip
        return self.o_proj(out.reshape(n, m, t, -1))

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        cache_len: jax.Array,
        new_mask: jax.Array | None,
        write_cache: bool = False,
        empty_cache: bool = False,
        causal: bool = False,
        packing: Packing | None = None,
        shared: SharedPrefix | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attends x's tokens to the cache and to each other.

        Args:
          x: [B, T, D] normalized hidden states, or [1, L, D] packed tokens with `packing`.
          positions: [B, T] int32 absolute positions (the padded layout, also with `packing`).
          k_cache, v_cache: [B, K, S, H].
          cache_len: [B] int32.
          new_mask: [B, T, T] bool, or None: causal by index (prompts, chains).
          write_cache: static; write the new keys/values at slots [cache_len, cache_len + T) of the cache.
          empty_cache: static promise that every cache_len is 0: attention skips the cache.
          causal: static promise that new_mask is lower-triangular.
          packing: x holds the packed tokens of the padded [B, T] layout (see dflax.models.packing): the
            projections run on them; attention runs on the pack on the CPU path and on the padded layout
            in the kernels. Only for prompts: needs `empty_cache` and a causal new_mask. With `shared`
            too, the packed tokens are the rows' own prompt rests on top of their groups' prefixes.
          shared: this layer's shared prefixes (`SharedPrefix.layer`): each row also attends to its group's
            prefix, in front of its own cache, by the two-level attention of pallas_kernels.shared_prefix
            (both levels as Pallas kernels where the backend is Pallas, jnp elsewhere; global-attention
            layers only).

        Returns:
          (out [B, T, D] (packed [1, L, D] with `packing`), k_cache, v_cache [B, K, S, H] with the new
          tokens written when `write_cache`, else as given).
        """
        cfg = self.cfg
        b, t = positions.shape
        token_positions = positions if packing is None else packing.pack(positions)[None]  # [B, T] or [1, L]
        q, k, v = self.project_qkv(x, token_positions)  # [B, T, N, H], [B, T, K, H] x 2
        # The new tokens are attended at the cache's precision, as every later step will see them.
        k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
        packed_out = None
        if packing is not None:
            if _attends_packed(cfg) and shared is not None:  # prompt rests over shared prefixes, CPU
                packed_out = _attend_packed_shared(cfg, shared, packing, q[0], k[0], v[0])
            elif _attends_packed(cfg):  # a prompt on the CPU: attention on the pack itself
                packed_out = packed_causal_attention(
                    q[0], k[0], v[0], packing.segment_ids, token_positions[0], sm_scale=cfg.scale,
                    sliding_window=cfg.sliding_window,
                ).reshape(1, packing.size, -1)  # fmt: skip
            else:
                q = packing.unpack(q[0])  # [B, T, N, H]
            k, v = packing.unpack(k[0]), packing.unpack(v[0])  # [B, T, K, H]
        if write_cache:
            k_cache, v_cache = write_kv(k_cache, k, cache_len), write_kv(v_cache, v, cache_len)
        if packed_out is not None:
            return self.o_proj(packed_out), k_cache, v_cache
        k_read, v_read = (k_cache[:, :, :0], v_cache[:, :, :0]) if empty_cache else (k_cache, v_cache)
        if shared is not None:
            out = _attend_shared(cfg, shared, q, k_read, v_read, cache_len, k, v, new_mask, causal)
        else:
            out = attend(cfg, q, k_read, v_read, cache_len, k, v, new_mask, positions, causal)  # [B, T, N, H]
        out = out.reshape(b, t, -1) if packing is None else packing.pack(out.reshape(b, t, -1))[None]
        return self.o_proj(out), k_cache, v_cache
