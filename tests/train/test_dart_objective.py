"""DART's objective and training on a tiny target.

- The depth weighting: KL per depth weighted 0.6^(t-1), invalid depths excluded, on a hand-computed case.
- The training forward (every position in one causal pass, one mask block per anchor) equals the decoding
  forward (`DartProposer.observe` of the prefix, in one or two pieces, then `draft_logits`) at every anchor.
- A short `train` run with a DART recipe lowers the loss, exports a directory (draft vocabulary, n-gram
  counts, TRAINING.json) that `dflax.load_drafter` loads with its measured acceptance, which the cost
  model reads, and decodes losslessly as a chain and as a tree.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from greedy_decoding import greedy
from rich.console import Console

import dflax
from dflax.drafters import DartDrafterBound, load_drafter
from dflax.drafters.dart import DartConfig, DartDrafter, DartParams, DartProposer, init_dart_params
from dflax.generation import encode_prompt
from dflax.models.cache import KVCache
from dflax.planning.cost_curve import AUTO_TREE_BUDGETS, auto_block_size
from dflax.train import dart_objective
from dflax.train.trainer import TrainConfig, train

QUIET = Console(quiet=True)


def test_depth_weighted_kl_on_a_hand_computed_case():
    np.testing.assert_allclose(dart_objective.depth_weights(4), [1.0, 0.6, 0.36, 0.216], rtol=1e-6)
    p = np.log([[[0.5, 0.5], [0.8, 0.2], [0.1, 0.9]]])  # [1, d=3, V=2]
    q = np.log([[[0.5, 0.5], [0.5, 0.5], [0.9, 0.1]]])
    kl2 = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)  # depth 1's KL is 0
    kl3 = 0.1 * math.log(0.1 / 0.9) + 0.9 * math.log(0.9 / 0.1)
    weighted = lambda valid: dart_objective.depth_weighted_kl(  # noqa: E731
        jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), jnp.asarray([valid]), 0.6
    )
    np.testing.assert_allclose(weighted([True, True, False]), 0.6 * kl2 / 1.6, rtol=1e-5)
    np.testing.assert_allclose(weighted([True, True, True]), (0.6 * kl2 + 0.36 * kl3) / 1.96, rtol=1e-5)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def test_training_forward_equals_the_decoding_forward(target):
    config = DartConfig.for_target(target.config, num_draft=4)
    module = DartDrafter(config)
    params = init_dart_params(module, seed=1)
    proposer = DartProposer(module, target.module)
    embed = target.params["params"]["embed_tokens"]["weight"]
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, target.config.vocab_size, (1, 24)), jnp.int32)
    positions = jnp.arange(24, dtype=jnp.int32)[None]
    cache = KVCache.init(target.config, 1, 24, jnp.float32)
    causal = jnp.tril(jnp.ones((1, 24, 24), jnp.bool_))
    _, _, taps = target.module.apply(
        target.params, tokens, positions, cache, causal, config.target_layer_ids, empty_cache=True
    )
    anchors = jnp.asarray([[0, 5, 9, 17]], jnp.int32)
    hidden = dart_objective.dart_hidden(module, params, embed, jnp.concatenate(taps, -1), tokens, anchors)
    trained = module.apply(params, hidden, method=DartDrafter.logits)  # [1, M, d, V]
    bound = DartParams(params, embed)
    for m, a in enumerate(np.asarray(anchors[0])):
        for split in sorted({a + 1, min(3, a + 1)}):  # the prefix observed in one piece, or two
            state = proposer.init_state(1, 32, jnp.float32)
            for lo, hi in ((0, split), (split, a + 1)):
                if hi > lo:
                    piece = (tokens[:, lo:hi], tuple(t[:, lo:hi] for t in taps), positions[:, lo:hi])
                    state = proposer.observe(bound, state, *piece, jnp.asarray([hi - lo]))
            decoded = proposer.draft_logits(bound, state, tokens[:, a + 1])  # [1, d, V]
            np.testing.assert_allclose(decoded[0], trained[0, m], atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def sequences(target):
    """(ids, prompt_len) pairs: random prompts + the target's greedy continuation (40 tokens)."""
    rng = np.random.default_rng(0)
    prompts = [" ".join(f"w{t}" for t in rng.integers(3, 256, rng.integers(4, 12))) for _ in range(40)]
    results = dflax.generate(target, prompts, max_new_tokens=40, temperature=0.0, batch_size=16)
    return [
        (np.asarray(encode_prompt(target, p) + r.tokens, np.int32), len(encode_prompt(target, p)))
        for p, r in zip(prompts, results)
    ]


def test_dart_training_exports_a_lossless_drafter(target, sequences, tmp_path):
    recipe = TrainConfig(
        method="dart",
        target="tiny",
        num_layers=1,
        block_size=5,
        draft_vocab_size=96,
        anchors_per_seq=16,
        max_seq_len=64,
        batch_size=4,
        lr=3e-3,
        steps=60,
        validate_every=60,
        log_every=10,
        export_dtype="float32",
        ngram_min_count=1,
    )
    result = train(recipe, target, sequences[:32], sequences[32:], tmp_path, console=QUIET)
    losses = [r["loss"] for r in result.log if "loss" in r]
    assert losses[-1] < 0.7 * losses[0], losses
    validation = [r for r in result.log if "val_tau" in r][-1]
    assert len(validation["val_accept"]) == 4
    assert sorted(p.name for p in result.drafter_dir.glob("ngram-*.npz")) == ["ngram-2.npz", "ngram-3.npz"]
    drafter = load_drafter(result.drafter_dir, target)
    assert isinstance(drafter, DartDrafterBound) and len(drafter.proposer.draft_vocab) == 96
    assert len(drafter.params.ngram) == 2
    # The export carries its measured acceptance, so the cost model can choose its chain or tree.
    assert drafter.accept == pytest.approx(validation["val_accept"], abs=1e-6)
    assert len(drafter.rank_accept) == 4 and drafter.trained_block_size == 5
    chosen, choice = auto_block_size(target, drafter.with_tree_budget(60), rows=1, context=24)
    assert set(choice.predicted) == {2, 3, 4} and set(choice.predicted_trees) == set(AUTO_TREE_BUDGETS)
    if chosen is not None:  # the tiny target's timings decide whether anything pays
        assert isinstance(chosen, DartDrafterBound)
        assert chosen.proposer.num_positions == choice.block_size - 1
        assert chosen.proposer.tree_budget == choice.tree_budget
    prompts = [list(ids[:p]) for ids, p in sequences[32:35]] + [[5, 6]]
    expected, _ = greedy(target, prompts, 24)
    for budget in (0, 16):
        got, _ = greedy(target, prompts, 24, drafter.with_tree_budget(budget))
        assert got == expected


def test_dart_recipe_is_validated():
    with pytest.raises(ValueError, match="num_layers 1 and init 'random'"):
        TrainConfig(method="dart", num_layers=3, block_size=9)
    with pytest.raises(ValueError, match="method 'medusa' unknown"):
        TrainConfig(method="medusa")
    recipe = TrainConfig.from_json(Path(__file__).parents[2] / "configs/train/dart-smollm2.json")
    assert recipe.method == "dart" and recipe.block_size - 1 == 8
