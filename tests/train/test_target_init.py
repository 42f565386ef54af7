"""Starting a drafter from its target's last layers: copied weights, exact context projection, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

import dflax
from dflax.drafters.dflash import DFlashConfig, DFlashDrafter, init_drafter_params
from dflax.models.cache import KVCache
from dflax.train.target_init import check_copyable, init_from_target
from dflax.train.trainer import TrainConfig, train


def _drafter(target, num_layers, taps, layer_arch="qwen3"):
    config = DFlashConfig.for_target(target.config, num_layers, 8, taps, layer_arch=layer_arch)
    module = DFlashDrafter(config, jnp.float32, "reference")
    return config, module, init_drafter_params(module, seed=3)


def _target_cache(target, tokens):
    """The target's per-layer keys/values after a causal prefill of tokens [1, S]."""
    s = tokens.shape[1]
    positions = jnp.arange(s, dtype=jnp.int32)[None]
    cache = KVCache.init(target.config, 1, s, jnp.float32)
    causal = jnp.tril(jnp.ones((1, s, s), jnp.bool_))
    _, cache, taps = target.module.apply(target.params, tokens, positions, cache, causal, (0,))
    return cache, taps[0], positions


@pytest.mark.parametrize("arch, layer_kind", [("qwen3", "qwen3"), ("llama", "qwen3"), ("llama", "target")])
def test_copied_layer_projects_the_context_as_the_target_does(tiny_checkpoint, arch, layer_kind):
    target = dflax.load_target(str(tiny_checkpoint(arch)[0]))
    n = target.config.num_layers  # 3: the drafter copies layers 1 and 2, the tap (layer 0) feeds layer 1
    recipe = TrainConfig(num_layers=2, block_size=8, target_layer_ids=(0,), layer_kind=layer_kind)
    config = recipe.drafter_config(target)
    module = DFlashDrafter(config, jnp.float32, "reference")
    params = init_drafter_params(module, seed=3)
    started = init_from_target(params, target.params, target.config, config)

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 200, (1, 12)), jnp.int32)
    cache, tap, positions = _target_cache(target, tokens)
    ks, vs = module.apply(started, tap, positions, method=DFlashDrafter.context_kv)
    np.testing.assert_allclose(vs[0], jnp.swapaxes(cache.v[1], 1, 2)[:, :12], rtol=1e-5, atol=1e-5)
    if config.layers.arch == arch:  # layers of the target's kind: the copied keys are the target's
        np.testing.assert_allclose(ks[0], jnp.swapaxes(cache.k[1], 1, 2)[:, :12], rtol=1e-5, atol=1e-5)
    else:  # Qwen3-kind layers on a Llama target: a k norm the target lacks, so only values match
        assert np.all(np.asarray(started["params"]["layers_0"]["self_attn"]["k_norm"]["weight"]) == 1.0)
        assert np.abs(np.asarray(ks[0]) - np.asarray(jnp.swapaxes(cache.k[1], 1, 2)[:, :12])).max() > 1e-3

    source = target.params["params"]
    np.testing.assert_array_equal(
        started["params"]["layers_1"]["mlp"]["down_proj"]["weight"],
        source[f"layers_{n - 1}"]["mlp"]["down_proj"]["weight"],
    )
    np.testing.assert_array_equal(started["params"]["norm"]["weight"], source["norm"]["weight"])
    np.testing.assert_array_equal(started["params"]["mask_embedding"], params["params"]["mask_embedding"])
    assert jax.tree.structure(started) == jax.tree.structure(params)
    assert all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(started), jax.tree.leaves(params))
    )


def test_fc_selects_the_last_tap(tiny_checkpoint):
    target = dflax.load_target(str(tiny_checkpoint("qwen3")[0]))
    config, module, params = _drafter(target, 1, (0, 1))
    started = init_from_target(params, target.params, target.config, config)
    d = target.config.hidden_size
    x = np.random.default_rng(1).normal(size=(2 * d,)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(started["params"]["fc"]["weight"]) @ x, x[d:], rtol=1e-6)


def test_a_target_with_other_layers_is_refused(tiny_checkpoint):
    target = dflax.load_target(str(tiny_checkpoint("gemma3")[0]))
    config = DFlashConfig.for_target(target.config, 1, 8)
    with pytest.raises(ValueError, match="use init 'random'"):
        check_copyable(target.config, config)
    llama = dflax.load_target(str(tiny_checkpoint("llama")[0]))
    with pytest.raises(ValueError, match="at most"):
        check_copyable(llama.config, DFlashConfig.for_target(llama.config, llama.config.num_layers + 1, 8))


def test_recipe_rejects_an_unknown_init_and_layer_kind(tiny_checkpoint):
    with pytest.raises(ValueError, match="init 'pretrained' unknown"):
        TrainConfig(init="pretrained")
    with pytest.raises(ValueError, match="layer_kind 'gemma3' unknown"):
        TrainConfig(layer_kind="gemma3")
    gemma = dflax.load_target(str(tiny_checkpoint("gemma3")[0]))
    with pytest.raises(ValueError, match="use layer_kind 'qwen3'"):
        TrainConfig(layer_kind="target").drafter_config(gemma)


def test_training_starts_from_the_target(tiny_checkpoint, tmp_path):
    """A run with init 'target' trains (its parameters never alias the target's donated buffers)."""
    target = dflax.load_target(str(tiny_checkpoint("llama")[0]))
    rng = np.random.default_rng(2)
    sequences = [(rng.integers(3, 200, 30).astype(np.int32), 6) for _ in range(8)]
    config = TrainConfig(
        target="tiny", init="target", layer_kind="target", num_layers=2, block_size=8, anchors_per_seq=4,
        max_seq_len=32, batch_size=4, logits_chunk=16, steps=2, checkpoint_every=1, log_every=1,
        validate_every=2,
    )  # fmt: skip
    result = train(config, target, sequences, sequences[:4], tmp_path, console=Console(quiet=True))
    assert result.step == 2 and result.drafter_dir is not None
    assert np.isfinite([e["loss"] for e in result.log if "loss" in e]).all()
