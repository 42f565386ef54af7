"""`tree_attention`: the public entry point, dispatching to the jnp reference or a Pallas kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention import gpu, tpu
from pallas_kernels.tree_attention.chunked import tree_attention_chunked
from pallas_kernels.tree_attention.reference import check_inputs, tree_attention_reference

BACKENDS = ("auto", "reference", "chunked", "tpu", "gpu")


def resolve_backend(backend: str) -> str:
    """'auto' -> 'tpu' / 'gpu' by `jax.default_backend()`, else 'chunked'; other names pass through."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} unknown; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    return platform if platform in ("tpu", "gpu") else "chunked"


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "logit_soft_cap",
        "backend",
        "interpret",
        "block_sizes",
        "causal",
        "return_lse",
    ),
)
def tree_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_len: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    tree_mask: jax.Array | None,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    q_positions: jax.Array | None = None,
    backend: str = "auto",
    interpret=False,
    block_sizes: tpu.BlockSizes | gpu.BlockSizes | None = None,
    causal: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of n new tokens to a cached prefix and to each other under a tree mask.

    The verification step of speculative decoding: every node of a draft tree (or chain) attends to the
    committed prefix, cache slots [0, cache_len), and to its ancestors among the new tokens. The kernels
    pack all n nodes x all query heads of one KV head into one query tile, so each prefix KV tile is read
    once per KV head (shared-prefix attention: FlashForge, Hydragen, DeFT, FlashInfer cascade), and merge
    the prefix and tree parts by log-sum-exp. The same call serves decode (n = 1, mask all True), chains
    (causal mask) and prefill (cache_len = 0, causal mask over the prompt).

    Args:
      q: [B, T, N, H] queries.
      k_cache: [B, K, S, H] cached keys (head-major); slot j has absolute position j; slots >= cache_len
        are never read.
      v_cache: [B, K, S, H] cached values.
      cache_len: [B] int valid prefix length per row.
      k_new: [B, T, K, H] keys of the new tokens.
      v_new: [B, T, K, H] values of the new tokens.
      tree_mask: [B, T, T] bool; tree_mask[b, i, j] = query i may see new token j. None = causal by index
        (j <= i: prompts and chains); the kernels then compute the mask from iotas. A given mask reaches
        the kernels as bit words (one bit per query row and key), never as a dense int32 array.
      sm_scale: logit scale; default H ** -0.5.
      sliding_window: python int w; a key at position kp is visible to a query at qp only if qp - kp < w.
      logit_soft_cap: c; logits -> c * tanh(logits / c) after scaling.
      q_positions: [B, T] int positions of the new tokens; default cache_len[:, None] + arange(T).
      backend: "reference" (dense jnp: the specification), "chunked" (jnp whose cost follows cache_len:
        the CPU path), "tpu" (Pallas Mosaic), "gpu" (Pallas Triton), or "auto" (by
        `jax.default_backend()`: tpu, gpu, else chunked).
      interpret: run the Pallas kernel in interpret mode (CPU). For "tpu", True means
        `pltpu.InterpretParams()`; an explicit InterpretParams is also accepted. Ignored by the reference.
      block_sizes: `tpu.BlockSizes` / `gpu.BlockSizes` for the matching backend; None = defaults.
      causal: static promise that tree_mask[b, i, j] is False for j > i (prompts, chains, trees in
        topological order); the chunked backend then skips the keys after each query block.
      return_lse: also return each query's log-sum-exp over the keys it sees, [B, T, N] fp32 (-inf for
        none), so that a caller can merge this attention with attention over other keys (the
        shared-prefix attention does).

    Returns:
      [B, T, N, H] attention output in q's dtype (fp32 accumulation); rows that see no key are zero. With
      return_lse, (output, log-sum-exp).
    """
    check_inputs(
        q,
        k_cache,
        v_cache,
        cache_len,
        k_new,
        v_new,
        tree_mask,
        q_positions=q_positions,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
    )
    resolved = resolve_backend(backend)
    args = (q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask)
    options = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
        q_positions=q_positions,
        return_lse=return_lse,
    )
    if resolved == "reference":
        return tree_attention_reference(*args, **options)
    if resolved == "chunked":
        return tree_attention_chunked(*args, **options, causal=causal)
    if resolved == "tpu":
        return tpu.tree_attention_tpu(*args, **options, block_sizes=block_sizes, interpret=interpret)
    if k_cache.shape[2] == 0:  # an empty cache (prefill): the GPU kernel tiles over at least one slot
        pad = ((0, 0), (0, 0), (0, 1), (0, 0))
        args = (q, jnp.pad(k_cache, pad), jnp.pad(v_cache, pad), jnp.zeros_like(cache_len), *args[4:])
    return gpu.tree_attention_gpu(*args, **options, block_sizes=block_sizes, interpret=bool(interpret))
