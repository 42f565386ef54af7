"""The KV caches are updated in place: the compiled prefill and decode loop hold no copy of a cache buffer.

A copy of every layer's K and V per step (what a write racing a read of the old buffer makes XLA do) costs
more than the attention itself on a CPU, and grows with the number of slots, not with the filled length.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import dflax
from dflax.decoding.cache import KVCache
from dflax.decoding.decode import decode_loop, prefill
from dflax.decoding.sampling import SamplingParams

BATCH, SLOTS, PROMPT = 3, 328, 16  # 328 slots: a shape no other array of the step has


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def cache_copies(hlo: str, config) -> int:
    """Number of copy instructions whose result has a cache buffer's shape, not counting the one-time
    materialization of a zero-filled buffer (a copy of a broadcast, e.g. the drafter's empty cache)."""
    shape = re.escape(f"f32[{BATCH},{config.num_kv_heads},{SLOTS},{config.head_dim}]")  # [B, K, S, H]
    return len(re.findall(rf"= {shape}\S* copy\(%(?!(wrapped_)?broadcast)", hlo))


@pytest.mark.parametrize("with_drafter", ["plain", "dflash", "dflash-tree", "lookup"])
def test_prefill_and_decode_loop_do_not_copy_the_cache(target, with_drafter):
    """Lookup's steps choose between a plain step and a verify of drafts (`lax.cond`): neither copies. A
    tree's step moves the accepted path's K/V inside the cache (`compact_path`): in place too."""
    drafter = {
        "plain": None,
        "dflash": dflax.load_drafter("untrained", target, block_size=4),
        "dflash-tree": dflax.load_drafter("untrained", target, block_size=4).with_tree_budget(6),
        "lookup": dflax.prompt_lookup(4),
    }[with_drafter]
    proposer = drafter.proposer if drafter else None
    drafter_params = drafter.params if drafter else None
    sampling = SamplingParams.make(0.0)
    prefill_fn = jax.jit(
        functools.partial(prefill, target.module, proposer=proposer, max_tokens=32),
        donate_argnames=("cache",),
    )
    args = (
        target.params,
        jnp.ones((BATCH, PROMPT), jnp.int32),
        jnp.full((BATCH,), 5, jnp.int32),
        KVCache.init(target.config, BATCH, SLOTS, jnp.float32),
        jnp.full((BATCH,), 32, jnp.int32),
        jax.vmap(jax.random.key)(jnp.arange(BATCH, dtype=jnp.uint32)),
        jnp.asarray([0], jnp.int32),
        sampling,
        drafter_params,
    )
    assert cache_copies(prefill_fn.lower(*args).compile().as_text(), target.config) == 0
    state = prefill_fn(*args)
    loop = jax.jit(
        functools.partial(decode_loop, target.module, proposer=proposer), donate_argnames=("state",)
    )
    hlo = loop.lower(target.params, state, sampling, drafter_params).compile().as_text()
    assert cache_copies(hlo, target.config) == 0
    if with_drafter.startswith("dflash"):
        assert cache_copies(hlo, drafter.proposer.module.config.layers) == 0
