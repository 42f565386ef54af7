"""DART: its beam tree equals a numpy reference, its n-gram prior a dict, and decoding with it is lossless.

- `ngram_probability` (trigram, back-off to bigram) equals a Python dict of the same corpus.
- `dart_tree` equals a plain-Python beam written from the paper's description (top k per depth, beam W,
  the depth-weighted score, no n-gram term at depth 0, unseen 1e-10, EOS-ending members last), with and
  without n-gram priors: the same N paths with the same scores, parents first.
- Greedy decoding with an untrained DART drafter (chain; trees with and without an n-gram prior) equals
  plain greedy decoding token for token in a mixed-length batch, and the batch equals each prompt alone.
- The checkpoint directory round-trips (weights, draft vocabulary, n-gram tables) and a misfit fails at load.
- At a geometry whose axes all differ and at SmolLM2-135M's heads (9, 3 KV, head dim 64), an untrained
  drafter initialises, its first proposal after prefill equals the training forward's (which lays out the
  context keys on its own), and greedy decoding with it is lossless (a regression: init once handed
  attention sequence-major keys where it reads the head-major cache's [B, K, S, H]).
"""

from __future__ import annotations

import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from greedy_decoding import greedy

import dflax
from dflax.checkpoints.params import CheckpointError
from dflax.decoding.decode import prefill
from dflax.decoding.sampling import SamplingParams, first_argmax
from dflax.decoding.tree import ancestor_mask, depths, with_root
from dflax.drafters import load_drafter
from dflax.drafters.dart import DartDrafter
from dflax.drafters.dart_loader import load_dart
from dflax.drafters.dart_tree import BeamSettings, NgramPrior, dart_tree, ngram_probability
from dflax.drafters.ngram import build_ngram_table
from dflax.models.cache import KVCache
from dflax.train.dart_objective import dart_hidden

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]


def corpus(seed=0, vocab=12, count=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(2, 20)).astype(np.int32) for _ in range(count)]


def dict_probability(sequences, context, token):
    """p(token | context) with back-off from trigram to bigram counts, from Python Counters."""
    for order in (3, 2):
        grams = Counter(tuple(s[i : i + order]) for s in sequences for i in range(len(s) - order + 1))
        ctx = tuple(context[len(context) - (order - 1) :])
        total = sum(c for g, c in grams.items() if g[:-1] == ctx)
        if grams.get(ctx + (token,), 0):
            return grams[ctx + (token,)] / total
    return 0.0


def test_ngram_probability_equals_a_dict_with_back_off():
    sequences = corpus()
    priors = [NgramPrior.from_table(build_ngram_table(sequences, n)) for n in (3, 2)]
    rng = np.random.default_rng(1)
    context = rng.integers(0, 13, (200, 2)).astype(np.int32)  # token 12 never occurs
    tokens = rng.integers(0, 13, 200).astype(np.int32)
    got = np.asarray(ngram_probability(priors, jnp.asarray(context), jnp.asarray(tokens)))
    expected = [dict_probability(sequences, tuple(c), int(t)) for c, t in zip(context, tokens)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert 0 < np.mean(np.asarray(expected) == 0) < 1  # unseen and seen tokens both tested


def reference_beam(probs, tokens, root, eos, sequences, num_nodes, s: BeamSettings):
    """The paper's beam in plain Python: [(path tuple, score)] of the kept nodes, best first."""
    d, _ = probs.shape
    everything, beam = [], [((), 0.0)]
    for level in range(d):
        children = []
        for path, score in beam:
            for p, tok in zip(probs[level], tokens[level]):
                term = s.logit_decay**level * np.log(p + 1e-10)
                if level > 0 and sequences is not None:
                    context = ((root,) + path)[-2:]
                    term += s.ngram_weight * np.log(dict_probability(sequences, context, int(tok)) + 1e-10)
                children.append((path + (int(tok),), score + (level + 1) ** -s.depth_exponent * term))
        everything += children
        ordered = sorted(children, key=lambda c: (c[0][-1] in eos, -c[1]))  # stable: ties keep order
        beam = ordered[: s.beam_width]
    return sorted(everything, key=lambda c: -c[1])[:num_nodes]


@pytest.mark.parametrize("with_ngram", [False, True])
@pytest.mark.parametrize("depth, k, width, budget", [(4, 5, 3, 20), (3, 6, 20, 40), (5, 3, 2, 12)])
def test_beam_tree_equals_the_reference(depth, k, width, budget, with_ngram):
    rng = np.random.default_rng(depth * 100 + k)
    rows = 3
    sequences = corpus(seed=depth) if with_ngram else None
    raw = rng.normal(size=(rows, depth, k)) * 2
    probs = np.exp(raw) / np.exp(raw).sum(-1, keepdims=True)
    tokens = np.stack([rng.permutation(12)[:k] for _ in range(rows * depth)]).reshape(rows, depth, k)
    roots = rng.integers(0, 12, rows)
    eos = (3,)
    settings = BeamSettings(top_k=k, beam_width=width)
    priors = [NgramPrior.from_table(build_ngram_table(sequences, n)) for n in (3, 2)] if with_ngram else None
    tree = dart_tree(
        jnp.asarray(probs, jnp.float32),
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(roots, jnp.int32),
        jnp.asarray(eos, jnp.int32),
        priors,
        budget,
        settings,
    )
    node_tokens, parents = with_root(tree, jnp.asarray(roots, jnp.int32))
    node_depths = np.asarray(depths(ancestor_mask(parents)))
    node_tokens, parents = np.asarray(node_tokens), np.asarray(parents)
    for r in range(rows):
        paths = []
        for node in range(1, budget + 1):
            assert parents[r, node] < node
            path, at = [], node
            while at:
                path.append(int(node_tokens[r, at]))
                at = parents[r, at]
            assert len(path) == node_depths[r, node]
            paths.append(tuple(reversed(path)))
        expected = reference_beam(probs[r], tokens[r], int(roots[r]), eos, sequences, budget, settings)
        assert sorted(paths) == sorted(p for p, _ in expected)


def test_tree_budget_beyond_the_beam_is_refused():
    with pytest.raises(ValueError, match="choose a tree budget in"):
        dart_tree(
            jnp.ones((1, 2, 3)) / 3, jnp.zeros((1, 2, 3), jnp.int32), jnp.zeros((1,), jnp.int32),
            jnp.zeros((1,), jnp.int32), None, 20, BeamSettings(top_k=3, beam_width=2),
        )  # fmt: skip


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


@pytest.fixture(scope="module")
def ngram_tables():
    return [build_ngram_table(corpus(vocab=60, count=60), n) for n in (3, 2)]


@pytest.mark.parametrize("budget, prior", [(0, False), (20, False), (40, True)])
def test_untrained_dart_is_lossless(target, ngram_tables, budget, prior):
    drafter = load_dart("untrained", target, tree_budget=budget)
    if prior:
        drafter = drafter.with_ngram(ngram_tables)
    expected, _ = greedy(target, PROMPTS, 30)
    got, results = greedy(target, PROMPTS, 30, drafter)
    assert got == expected
    width = (budget or drafter.config.num_draft) + 2
    assert all(len(r.stats["accept_hist"]) == width and r.stats["tau"] >= 1.0 for r in results)


def test_dart_batch_equals_each_prompt_alone(target, ngram_tables):
    drafter = load_dart("untrained", target, tree_budget=16).with_ngram(ngram_tables)
    batched, _ = greedy(target, PROMPTS, 20, drafter, batch_size=4)
    for prompt, got in zip(PROMPTS, batched):
        assert greedy(target, [prompt], 20, drafter, batch_size=1)[0] == [got]


def test_checkpoint_round_trip(target, ngram_tables, tmp_path):
    drafter = load_dart("untrained", target, seed=3).with_ngram(ngram_tables)
    drafter.save(tmp_path / "dart")
    loaded = load_drafter(tmp_path / "dart", target)  # dflax.load_drafter recognises the directory
    assert loaded.config == drafter.config
    mine, theirs = _leaves(drafter.params.drafter), _leaves(loaded.params.drafter)
    assert mine.keys() == theirs.keys()
    for name in mine:
        np.testing.assert_array_equal(np.asarray(mine[name]), np.asarray(theirs[name]), err_msg=name)
    assert len(loaded.params.ngram) == 2
    for prior, read in zip(drafter.params.ngram, loaded.params.ngram):
        for field in ("grams", "gram_counts", "contexts", "context_counts"):
            np.testing.assert_array_equal(getattr(prior, field), getattr(read, field))
    runs = [greedy(target, PROMPTS, 8, d.with_tree_budget(12))[1] for d in (drafter, loaded)]
    hist = lambda results: [(r.tokens, r.stats["accept_hist"]) for r in results]  # noqa: E731
    assert hist(runs[0]) == hist(runs[1])

    config = json.loads((tmp_path / "dart/config.json").read_text())
    config["dart_config"]["target_layer_ids"] = [0, 99]  # as many taps: the weights still fit
    (tmp_path / "dart/config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not built for this target"):
        load_drafter(tmp_path / "dart", target)
    config["dart_config"]["target_layer_ids"] = [0, 1]
    config["hidden_size"] = 32
    (tmp_path / "dart/config.json").write_text(json.dumps(config))
    with pytest.raises((CheckpointError, ValueError)):
        load_drafter(tmp_path / "dart", target)


def _leaves(params):
    from flax.traverse_util import flatten_dict

    return {"/".join(k): v for k, v in flatten_dict(params["params"]).items()}


@pytest.fixture(scope="module", params=["distinct-axes", "smollm2-heads"])
def geometry_target(request, tiny_checkpoint):
    """A tiny target whose batch, prompt, head, KV head, head dim and vocabulary axes all differ, or one
    with SmolLM2-135M's attention heads (see tiny_checkpoints)."""
    return dflax.load_target(str(tiny_checkpoint(request.param)[0]))


def test_first_proposal_equals_the_training_forward(geometry_target):
    target = geometry_target
    drafter = load_dart("untrained", target)
    proposer, params = drafter.proposer, drafter.params
    lens = np.asarray([len(p) for p in PROMPTS], np.int32)
    b, p, max_new = len(PROMPTS), int(lens.max()), 4
    prompts = np.zeros((b, p), np.int32)
    for r, ids in enumerate(PROMPTS):
        prompts[r, : lens[r]] = ids

    @jax.jit
    def first_proposal(target_params, params):
        state = prefill(
            target.module,
            target_params,
            jnp.asarray(prompts),
            jnp.asarray(lens),
            KVCache.init(target.config, b, p + max_new + proposer.num_draft + 1, target.cache_dtype),
            jnp.full((b,), max_new, jnp.int32),
            jax.vmap(jax.random.key)(jnp.arange(b)),
            jnp.asarray(target.eos_ids, jnp.int32),
            SamplingParams.make(),
            params,
            max_tokens=max_new,
            proposer=proposer,
        )
        chain, _ = proposer.propose(params, target_params, state, None)  # [B, d]
        logits = proposer.draft_logits(params, state.drafter_state, state.last_token)  # [B, d, V]
        return state.last_token, chain, logits

    @jax.jit
    def training_forward(target_params, params, tokens):  # [B, P + 1] each prompt, then its first token
        positions = jnp.broadcast_to(jnp.arange(p + 1, dtype=jnp.int32), (b, p + 1))
        cache = KVCache.init(target.config, b, p + 1, target.cache_dtype)
        _, _, taps = target.module.apply(
            target_params, tokens, positions, cache, None, proposer.tap_layers, empty_cache=True
        )
        anchors = jnp.asarray(lens - 1)[:, None]  # [B, 1] each prompt's last position
        hidden = dart_hidden(
            proposer.module, params.drafter, params.embed, jnp.concatenate(taps, -1), tokens, anchors
        )
        return proposer.module.apply(params.drafter, hidden, method=DartDrafter.logits)[:, 0]  # [B, d, V]

    first, chain, decoded = first_proposal(target.params, params)
    np.testing.assert_array_equal(chain, first_argmax(decoded))
    tokens = np.pad(prompts, ((0, 0), (0, 1)))
    tokens[np.arange(b), lens] = np.asarray(first)
    trained = training_forward(target.params, params, jnp.asarray(tokens))
    np.testing.assert_allclose(decoded, trained, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [0, 12])
def test_untrained_dart_is_lossless_at_every_geometry(geometry_target, budget):
    drafter = load_dart("untrained", geometry_target, tree_budget=budget)
    expected, _ = greedy(geometry_target, PROMPTS, 12)
    got, _ = greedy(geometry_target, PROMPTS, 12, drafter)
    assert got == expected
