"""Worker of the sharded-generation tests, run in its own process with 8 fake CPU devices.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax starts, so the tests (which run
with one device) start this file with it. It generates with one target unsharded and on each mesh asked
for, plain, DFlash chains and (with a tree_budget) DFlash trees, at T=0 and T=1 with fixed seeds, and
prints one JSON object: the tokens of every run, and how the compiled decode loop of each mesh received
every parameter (the shard shape of each input).

Usage: python sharded_run.py '{"target": ..., "drafter": ..., "meshes": [...], "prompts": [[...]],
  "max_new_tokens": N, "block_size": B, "tree_budget": N (optional)}'
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import dflax
from dflax.decoding.sampling import SamplingParams
from dflax.runtime.programs import compiled_programs, mesh_rules
from dflax.runtime.static_batches import generate_ids
from dflax.sharding.placement import place_replicated, place_rows, sharded_cache

TEMPERATURES = (0.0, 1.0)


def run(target, drafter, spec) -> dict:
    """method/temperature -> the tokens of every prompt."""
    out = {}
    methods = [("ar", None), ("dflash", drafter)]
    if spec.get("tree_budget"):  # best-first trees over the DFlash block, verified under their ancestor mask
        methods.append(("dflash-tree", drafter.with_tree_budget(spec["tree_budget"])))
    for method, d in methods:
        for temperature in TEMPERATURES:
            results = generate_ids(
                target,
                spec["prompts"],
                max_new_tokens=spec["max_new_tokens"],
                sampling=SamplingParams.make(temperature),
                row_seeds=[7 + i for i in range(len(spec["prompts"]))],
                batch_size=len(spec["prompts"]),
                drafter=d,
            )
            out[f"{method}/T={temperature:g}"] = [r.tokens for r in results]
    return out


def compiled_param_shards(target, drafter) -> dict:
    """Parameter path -> [shard shape, full shape] as the compiled DFlash decode loop receives it (read
    from the executable's input shardings, not from the arrays passed)."""
    rules, proposer = mesh_rules(target), drafter.proposer
    prefill_fn, decode_fn = compiled_programs(target, proposer)
    batch = rules.mesh.shape["data"]
    tokens, lens, budgets = place_rows(rules, jnp.ones((batch, 16), jnp.int32), jnp.ones((batch,), jnp.int32),
                                       jnp.full((batch,), 4, jnp.int32))  # fmt: skip
    (keys,) = place_rows(rules, jax.vmap(jax.random.key)(jnp.arange(batch, dtype=jnp.uint32)))
    eos, sampling = place_replicated(rules, (jnp.asarray(target.eos_ids, jnp.int32), SamplingParams.make()))
    cache = sharded_cache(target.config, batch, 64, target.cache_dtype, rules)
    state = prefill_fn(target.params, tokens, lens, cache, budgets, keys, eos, sampling, drafter.params,
                       max_tokens=4, packed_tokens=None)  # fmt: skip
    compiled = decode_fn.lower(target.params, state, sampling, drafter.params).compile()
    (params_in, state_in, _, drafter_in), _ = compiled.input_shardings
    shards = {}
    for name, tree, arrays in (("target", params_in, target.params), ("drafter", drafter_in, drafter.params)):
        flat = jax.tree_util.tree_flatten_with_path(arrays)[0]
        for (path, leaf), sharding in zip(flat, jax.tree.leaves(tree)):
            key = name + ":" + "/".join(str(getattr(k, "key", k)) for k in path[1:])
            shards[key] = [list(sharding.shard_shape(leaf.shape)), list(leaf.shape)]
    cache_k = state.cache.k[0]
    shards["cache:k0"] = [list(state_in.cache.k[0].shard_shape(cache_k.shape)), list(cache_k.shape)]
    return shards


def main(spec: dict) -> dict:
    base = dflax.load_target(spec["target"])
    drafter = dflax.load_drafter(spec["drafter"], base, block_size=spec["block_size"])
    report = {"devices": jax.device_count(), "unsharded": run(base, drafter, spec), "meshes": {}}
    for mesh in spec["meshes"]:
        target = dflax.load_target(spec["target"], mesh=mesh)
        sharded_drafter = dflax.load_drafter(spec["drafter"], target, block_size=spec["block_size"])
        # The same drafter weights as the unsharded run (an untrained drafter is seeded, a trained one read).
        for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(sharded_drafter.params)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        report["meshes"][mesh] = {
            "tokens": run(target, sharded_drafter, spec),
            "shards": compiled_param_shards(target, sharded_drafter),
        }
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
