"""The adapted diffusion drafter: its cached decoding forward, its training objective, its directory, its
training run and the shipped SmolLM2 drafter."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

import dflax
from dflax.checkpoints.params import CheckpointError
from dflax.diffusion.adapted_checkpoint import (
    is_adapted_drafter_dir,
    load_adapted_drafter,
    save_adapted_drafter,
)
from dflax.diffusion.adapted_drafter import (
    AdaptedConfig,
    AdaptedDrafter,
    AdaptedLayers,
    init_adapted_params,
    shared_params,
)
from dflax.drafters.shipped import shipped_diffusion_drafter_path
from dflax.generation import encode_prompt
from dflax.models.cache import KVCache
from dflax.train import diffusion_objective, objective
from dflax.train.diffusion_recipe import DiffusionTrainConfig, is_diffusion_recipe
from dflax.train.diffusion_trainer import train_diffusion

QUIET = Console(quiet=True)
MASK = 255
K = 4
REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("smollm2-like")[0]))


def _drafter(target, backend="auto", seed=1):
    """A drafter of target layers (2, 0) with every own weight perturbed (so none is the identity)."""
    config = AdaptedConfig.for_target(target.config, (2, 0), MASK, K)
    drafter = AdaptedDrafter(AdaptedLayers(config, jnp.float32, attention_backend=backend))
    own = init_adapted_params(drafter.module, seed)
    leaves, tree = jax.tree.flatten(own)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    own = jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    return drafter, {"drafter": own, **shared_params(target.config, target.params)}


def _block_causal_logits(drafter, params, prefix, last, window, t=32):
    """Reference: ONE forward over [prefix | last | window] (padded to t tokens that no real token sees)
    with an empty cache and the block-causal mask (the prefix causal, the block seeing the prefix and
    itself), read at the block's first K positions."""
    n, end = len(prefix), len(prefix) + 1 + len(window)
    tokens = np.zeros(t, np.int32)
    tokens[:end] = np.concatenate([prefix, [last], window])
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = np.where(i < n, j <= i, np.where(i < end, j < end, j <= i))
    module = drafter.module
    cache = KVCache.init(module.config.layers, 1, t, jnp.float32)
    x = module.apply(
        params["drafter"], params["embedding"], jnp.asarray(tokens[None]), method=AdaptedLayers.embed
    )
    hidden, _ = module.apply(params["drafter"], x, jnp.arange(t)[None], cache, jnp.asarray(mask[None]),
                             empty_cache=True)  # fmt: skip
    return drafter.readout(params, hidden[0, n : n + len(window)])  # [K, V]


def test_cached_window_logits_equal_one_block_causal_forward(target):
    drafter, params = _drafter(target)
    rng = np.random.default_rng(0)
    lengths = np.asarray([5, 11, 1])  # a mixed-length batch
    seqs = [rng.integers(3, 250, n + 1) for n in lengths]  # each prefix + its last committed token
    windows = np.full((3, K), MASK, np.int32)
    windows[1, [0, 2]] = rng.integers(3, 250, 2)  # a refinement step: some slots already filled
    state = drafter.init_state(3, 32, jnp.float32)
    # Observed in two padded pieces of 8 tokens each: counts below 8 leave padding that must not matter.
    for lo in (0, 8):
        counts = np.clip(lengths - lo, 0, 8)
        tokens = np.zeros((3, 8), np.int32)
        for b, s in enumerate(seqs):
            tokens[b, : counts[b]] = s[lo : lo + counts[b]]
        tokens[tokens == 0] = 7  # padding that looks like real tokens
        positions = jnp.asarray(lo + np.arange(8)[None].repeat(3, 0), jnp.int32)
        state = drafter.observe(params, state, jnp.asarray(tokens), positions, jnp.asarray(counts, jnp.int32))
    np.testing.assert_array_equal(state.lengths, lengths)
    last = jnp.asarray([s[-1] for s in seqs], jnp.int32)
    got = drafter.window_logits(params, state, last, jnp.asarray(lengths, jnp.int32), jnp.asarray(windows))
    assert got.shape == (3, K, target.config.vocab_size) and got.dtype == jnp.float32
    for b, s in enumerate(seqs):
        want = _block_causal_logits(drafter, params, s[:-1], s[-1], windows[b])
        np.testing.assert_allclose(got[b], want, atol=2e-5, rtol=1e-5)
    assert np.all(np.asarray(got[..., MASK]) < -1e29)  # the mask is never drafted


def test_objective_equals_a_per_window_reference(target):
    drafter, params = _drafter(target, backend="reference")
    rng = np.random.default_rng(1)
    lengths = np.asarray([20, 13])
    tokens = np.zeros((2, 24), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(3, 250, n)
    prompt_lens = np.asarray([4, 6], np.int32)
    windows = diffusion_objective.make_windows(
        jax.random.key(3), jnp.asarray(tokens), jnp.asarray(prompt_lens), jnp.asarray(lengths, jnp.int32),
        6, K, MASK, 0.5,
    )  # fmt: skip
    scored = np.asarray(windows.scored)
    assert scored.any() and not scored.all()  # partly masked windows (and slots past the end) are there
    weights = objective.position_weights(K + 1, 3.0)
    loss, stats = diffusion_objective.diffusion_loss(
        drafter, params, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32), windows, weights, 5, 4
    )
    total, norm, correct = 0.0, 0.0, np.zeros(K)
    for r in range(windows.anchors.shape[0]):
        seq, a = tokens[r // 6], int(windows.anchors[r])
        inputs = np.asarray(windows.inputs[r])
        logits = np.asarray(_block_causal_logits(drafter, params, seq[:a], seq[a], inputs), np.float64)
        for k in range(K):
            if scored[r, k]:
                label = int(windows.labels[r, k])
                ce = np.log(np.sum(np.exp(logits[k] - logits[k].max()))) + logits[k].max() - logits[k, label]
                total += float(weights[k]) * ce
                norm += float(weights[k])
                correct[k] += int(np.argmax(logits[k]) == label)
    np.testing.assert_allclose(float(loss), total / norm, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(stats.correct, correct)
    np.testing.assert_array_equal(stats.valid, scored.sum(0))


def test_directory_round_trip(target, tmp_path):
    drafter, params = _drafter(target)
    save_adapted_drafter(tmp_path / "d", drafter.module.config, params["drafter"], "float32")
    assert is_adapted_drafter_dir(tmp_path / "d") and not is_adapted_drafter_dir(tmp_path)
    loaded, loaded_params = load_adapted_drafter(tmp_path / "d", target)
    assert loaded.module.config == drafter.module.config and loaded.mask_token_id == MASK
    jax.tree.map(np.testing.assert_array_equal, loaded_params, params)
    (tmp_path / "d" / "config.json").write_text((tmp_path / "d" / "config.json").read_text().replace(
        '"num_hidden_layers": 2', '"num_hidden_layers": 3'))  # fmt: skip
    with pytest.raises(CheckpointError):
        load_adapted_drafter(tmp_path / "d", target)
    with pytest.raises(FileNotFoundError, match="not an adapted diffusion drafter"):
        load_adapted_drafter(tmp_path, target)


@pytest.fixture(scope="module")
def sequences(target):
    """(ids, prompt_len): random prompts + the target's greedy continuation (32 tokens)."""
    rng = np.random.default_rng(0)
    prompts = [" ".join(f"w{t}" for t in rng.integers(3, 250, rng.integers(4, 10))) for _ in range(24)]
    results = dflax.generate(target, prompts, max_new_tokens=32, temperature=0.0, batch_size=12)
    ids = [encode_prompt(target, p) for p in prompts]
    return [(np.asarray(i + r.tokens, np.int32), len(i)) for i, r in zip(ids, results)]


def test_training_lowers_the_loss_and_exports_a_drafter(target, sequences, tmp_path):
    recipe = DiffusionTrainConfig(
        target="tiny", source_layers=(0, 2), mask_token_id=MASK, window=K, windows_per_seq=8,
        max_seq_len=48, batch_size=4, lr=3e-3, steps=40, validate_every=20, checkpoint_every=20,
        log_every=10, export_dtype="float32",
    )  # fmt: skip
    result = train_diffusion(recipe, target, sequences[:20], sequences[20:], tmp_path, console=QUIET)
    report = __import__("json").loads((result.drafter_dir / "TRAINING.json").read_text())
    assert report["steps"] == 40 and len(report["chance"]["unigram_acc"]) == K
    losses = [loss for _, loss in report["losses"]]
    assert losses[-1] < 0.7 * losses[0], losses
    assert report["final_validation"]["val_loss"] < report["chance"]["init_loss"]
    drafter, params = load_adapted_drafter(result.drafter_dir, target)
    jax.tree.map(np.testing.assert_array_equal, params["drafter"], result.params)
    assert drafter.module.config.source_layers == (0, 2)


def test_recipe_and_its_file():
    path = REPO / "configs/train/diffusion-smollm2.json"
    assert is_diffusion_recipe(path) and not is_diffusion_recipe(REPO / "configs/train/dflash-smollm2.json")
    recipe = DiffusionTrainConfig.from_json(path)
    assert recipe.method == "diffusion" and recipe.target == "smollm2-135m"
    with pytest.raises(ValueError, match="all_masked_frac"):
        DiffusionTrainConfig(all_masked_frac=1.5)


def test_shipped_smollm2_drafter_loads_and_fits_the_budget(smollm2):
    path = shipped_diffusion_drafter_path("smollm2-135m")
    assert path is not None and is_adapted_drafter_dir(path)
    assert sum(f.stat().st_size for f in path.iterdir()) <= 30 * 2**20
    drafter, params = load_adapted_drafter(path, smollm2)
    ids = smollm2.tokenizer.encode("The capital of France is")
    state = drafter.init_state(1, 64, jnp.float32)
    n = len(ids) - 1
    state = drafter.observe(params, state, jnp.asarray([ids[:-1]]), jnp.arange(n)[None], jnp.asarray([n]))
    window = jnp.full((1, drafter.module.config.window), drafter.mask_token_id, jnp.int32)
    logits = drafter.window_logits(params, state, jnp.asarray([ids[-1]]), jnp.asarray([n]), window)
    assert logits.shape == (1, drafter.module.config.window, smollm2.config.vocab_size)
    assert np.isfinite(np.asarray(logits[..., : drafter.mask_token_id])).all()
