"""The compiled prefill and decode loop copy no KV cache buffer and no weight.

A copy of every layer's K and V per step (what a write racing a read of the old buffer makes XLA do) costs
more than the attention itself on a CPU, and grows with the number of slots, not with the filled length.
A transposed copy of a weight (what XLA's CPU backend gives a bf16 product whose left operand has more
than two axes) is hoisted out of the loop but paid on every call: a pass over every weight per batch.
A float32 conversion of a whole bf16 cache buffer or embedding table (XLA's CPU backend's way to slice,
update or gather bf16) costs the same kind of pass.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import dflax
from dflax.decoding.decode import decode_loop, prefill
from dflax.decoding.sampling import SamplingParams
from dflax.models.cache import KVCache

BATCH, SLOTS, PROMPT = 3, 328, 16  # 328 slots: a shape no other array of the step has


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def cache_copies(hlo: str, config) -> int:
    """Number of copy instructions whose result has a cache buffer's shape, not counting the one-time
    materialization of a zero-filled buffer (a copy of a broadcast, e.g. the drafter's empty cache)."""
    shape = re.escape(f"f32[{BATCH},{config.num_kv_heads},{SLOTS},{config.head_dim}]")  # [B, K, S, H]
    return len(re.findall(rf"= {shape}\S* copy\(%(?!(wrapped_)?broadcast)", hlo))


def widened(hlo: str, shape: tuple[int, ...]) -> int:
    """Number of instructions that convert a whole array of `shape` to float32 (plain or as a fusion)."""
    dims = re.escape(",".join(map(str, shape)))
    return len(re.findall(rf"= f32\[{dims}\]\S* (?:convert\(|fusion\(.*calls=%wrapped_convert)", hlo))


def weight_copies(hlo: str, params) -> int:
    """Number of copies (plain or as a fusion) whose result has the shape of a 2-D weight or of its
    transpose."""
    shapes = {w.shape for w in jax.tree.leaves(params) if w.ndim == 2}
    shapes |= {shape[::-1] for shape in shapes}
    copies = re.findall(r"= \w+\[(\d+),(\d+)\]\S* (?:copy\(|fusion\(.*calls=%wrapped_copy)", hlo)
    return sum((int(a), int(b)) in shapes for a, b in copies)


def compiled_programs(target, drafter) -> tuple[str, str]:
    """The optimized HLO of the prefill and of the decode loop, with the cache donated as in generation."""
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
        KVCache.init(target.config, BATCH, SLOTS, target.cache_dtype),
        jnp.full((BATCH,), 32, jnp.int32),
        jax.vmap(jax.random.key)(jnp.arange(BATCH, dtype=jnp.uint32)),
        jnp.asarray([0], jnp.int32),
        sampling,
        drafter_params,
    )
    prefill_hlo = prefill_fn.lower(*args).compile().as_text()
    state = prefill_fn(*args)
    loop = jax.jit(
        functools.partial(decode_loop, target.module, proposer=proposer), donate_argnames=("state",)
    )
    return prefill_hlo, loop.lower(target.params, state, sampling, drafter_params).compile().as_text()


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
    prefill_hlo, hlo = compiled_programs(target, drafter)
    assert cache_copies(prefill_hlo, target.config) == 0
    assert cache_copies(hlo, target.config) == 0
    if with_drafter.startswith("dflash"):
        assert cache_copies(hlo, drafter.proposer.module.config.layers) == 0


@pytest.mark.parametrize("tree_budget", [0, 6])
def test_bf16_prefill_and_decode_loop_do_not_copy_a_weight(tiny_checkpoint, tree_budget):
    """A bf16 target and drafter multiply verify blocks, draft blocks and single tokens by their weights
    as stored (each product on a 2-D left operand)."""
    target = dflax.load_target(str(tiny_checkpoint("qwen3")[0]), dtype="bfloat16")
    drafter = dflax.load_drafter("untrained", target, block_size=4).with_tree_budget(tree_budget)
    for hlo in compiled_programs(target, drafter):
        assert weight_copies(hlo, target.params) == 0
        assert weight_copies(hlo, drafter.params) == 0


@pytest.mark.parametrize("tree_budget", [0, 6])
def test_bf16_target_never_widens_its_cache_or_embedding_table(tiny_checkpoint, tree_budget):
    """XLA's CPU backend slices, updates and gathers a bf16 array by converting all of it to float32: a bf16
    KV cache would be widened whole in every layer of every step, and the embedding table once per call.
    On the CPU a bf16 target's cache is float32 (`default_cache_dtype`) and embedding rows are looked up
    in their bits, so no program converts a whole cache buffer or the table, and the cache stays in place."""
    target = dflax.load_target(str(tiny_checkpoint("qwen3")[0]), dtype="bfloat16")
    assert target.cache_dtype == jnp.float32
    drafter = dflax.load_drafter("untrained", target, block_size=4).with_tree_budget(tree_budget)
    cfg, drafter_cfg = target.config, drafter.proposer.module.config.layers
    for hlo in compiled_programs(target, drafter):
        for config in (cfg, drafter_cfg):
            assert cache_copies(hlo, config) == 0
            assert widened(hlo, (BATCH, config.num_kv_heads, SLOTS, config.head_dim)) == 0
        assert widened(hlo, (cfg.vocab_size, cfg.hidden_size)) == 0
