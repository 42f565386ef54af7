"""Tree verification: masks, the acceptance walk, compaction, and lossless decoding at every temperature.

- Masks and the walk on hand-made trees (the expected values written out).
- An oracle tree that holds the target's greedy path among decoy siblings: the output is plain greedy
  decoding's and every step commits depth + 1 tokens exactly.
- Compaction: the cache after a tree step equals the cache after a chain step that verified the same path,
  and so does the DFlash drafter's context (the accepted path's target features).
- Sampling: on the toy target of `toy_target`, trees built from the target's own top-2 tokens (so every
  path length is accepted) give the exact distribution at T=1 and at T=0.7 / top-p 0.9; a rule that draws
  a fresh sample where the walk stops (instead of committing the sample that matched no child) is caught.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from greedy_decoding import greedy
from sampling_definition import target_probs
from toy_target import TV_BOUND, compare, exact_joint, make_toy, sample_outcomes

import dflax
from dflax.decoding import decode
from dflax.decoding.decode import decode_step, prefill
from dflax.decoding.sampling import SamplingParams, sample, split_keys
from dflax.decoding.tree import DraftTree, accept_tree, ancestor_mask, depths, first_matching_child, walk
from dflax.drafters import load_drafter
from dflax.models.cache import KVCache
from dflax.models.transformer import Transformer

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def test_ancestor_mask_and_depths_of_a_hand_made_tree():
    # root 0 -> 1 -> 3 -> 5, root -> 2 -> 4; node 6 under 1.
    parents = jnp.asarray([[-1, 0, 0, 1, 2, 3, 1]])
    mask = np.asarray(ancestor_mask(parents))[0]
    expected = np.zeros((7, 7), bool)
    for node, ancestors in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 1, 3, 5],
                            6: [0, 1, 6]}.items():  # fmt: skip
        expected[node, ancestors] = True
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(depths(jnp.asarray(mask)[None])[0], [0, 1, 1, 2, 2, 3, 2])


def test_walk_follows_the_first_matching_child():
    # root 0 with children 1 (token 7) and 2 (token 7, a duplicate), 3 (token 8) under 1, 4 under 3.
    tokens = jnp.asarray([[0, 7, 7, 8, 9], [0, 7, 7, 8, 9]])
    parents = jnp.asarray([[-1, 0, 0, 1, 3], [-1, 0, 0, 1, 3]])
    wanted = jnp.asarray([[7, 8, 5, 9, 1], [7, 5, 5, 5, 5]])  # the target's token at every node
    next_node = first_matching_child(tokens, parents, wanted)
    np.testing.assert_array_equal(next_node, [[1, 3, -1, 4, -1], [1, -1, -1, -1, -1]])
    path, num = walk(next_node)
    np.testing.assert_array_equal(num, [3, 1])
    np.testing.assert_array_equal(path, [[0, 1, 3, 4, 4], [0, 1, 1, 1, 1]])


def test_accept_tree_at_temperature_zero_commits_the_path_and_the_argmax_after_it():
    tree = DraftTree(tokens=jnp.asarray([[3, 1, 2]]), parents=jnp.asarray([[0, 0, 2]]))
    argmax = [1, 4, 2, 0]  # the target's argmax at nodes 0..3: root -> node 2 (token 1) -> node 3 (2)
    logits = jax.nn.one_hot(jnp.asarray([argmax]), 5) * 5.0
    acc, path = accept_tree(jax.random.key(0), tree, jnp.asarray([9]), logits, SamplingParams.make())
    np.testing.assert_array_equal(acc.num_accepted, [2])
    np.testing.assert_array_equal(acc.tokens, [[1, 2, 0, 0]])  # path tokens, then argmax at node 3
    np.testing.assert_array_equal(path, [[0, 2, 3, 3]])


@dataclasses.dataclass(frozen=True, eq=False)
class OracleTreeProposer:
    """A tree holding the target's greedy future (from a table passed as parameters) down `depth` levels,
    each true node preceded by a decoy sibling (token + 1), so the walk must pick the second child.

    Nodes: 2d + 1 is the decoy and 2d + 2 the true node of depth d + 1, both children of node 2d.
    `wrong_at` replaces the true token at that depth (1-based) by a decoy of its own: the path stops there.
    """

    depth: int
    vocab: int
    wrong_at: int | None = None
    tap_layers: tuple[int, ...] = ()

    @property
    def num_draft(self) -> int:
        return 2 * self.depth

    def init_state(self, batch, slots, dtype):
        return None

    def observe(self, params, drafter_state, tokens, taps, positions, count):
        return None

    def propose(self, params, target_params, state, keys):
        index = state.num_generated[:, None] + jnp.arange(self.depth)
        true = jnp.take_along_axis(params, index, axis=1)  # [B, depth]
        if self.wrong_at is not None:
            true = true.at[:, self.wrong_at - 1].set((true[:, self.wrong_at - 1] + 2) % self.vocab)
        decoy = (true + 1) % self.vocab
        tokens = jnp.stack([decoy, true], axis=-1).reshape(true.shape[0], -1)  # [B, 2 depth]
        parents = jnp.repeat(2 * jnp.arange(self.depth, dtype=jnp.int32), 2)
        return DraftTree(tokens, jnp.broadcast_to(parents, tokens.shape)), None


@dataclasses.dataclass(frozen=True, eq=False)
class TableDrafter:
    """A drafter whose parameters are a table of each row's future tokens."""

    params: jax.Array
    proposer: object


def greedy_table(target, prompts, length):
    """The prompts' plain greedy outputs and a [B, length + 32] table of them for oracle drafters."""
    expected, _ = greedy(target, prompts, length)
    table = np.zeros((len(prompts), length + 32), np.int32)
    for r, e in enumerate(expected):
        table[r, : len(e)] = e
    return expected, jnp.asarray(table)


@pytest.mark.parametrize("depth", [3, 7])
def test_oracle_tree_commits_its_depth_plus_one(target, depth):
    max_new = 1 + 4 * (depth + 1)  # the prefill token, then exactly 4 whole paths
    expected, table = greedy_table(target, PROMPTS, max_new)
    oracle = TableDrafter(table, OracleTreeProposer(depth, target.config.vocab_size))
    got, results = greedy(target, PROMPTS, max_new, oracle)
    assert got == expected
    for r in results:
        assert r.stats["steps"] == 4 and r.stats["tau"] == depth + 1
        assert r.stats["accept_hist"][depth + 1] == 4


def test_oracle_tree_mixed_batch_equals_each_prompt_alone(target):
    expected, table = greedy_table(target, PROMPTS, 30)
    proposer = OracleTreeProposer(4, target.config.vocab_size, wrong_at=3)
    batched, _ = greedy(target, PROMPTS, 30, TableDrafter(table, proposer))
    assert batched == expected
    for r, prompt in enumerate(PROMPTS):
        alone = TableDrafter(table[r : r + 1], proposer)
        assert greedy(target, [prompt], 30, alone, batch_size=1)[0] == [batched[r]]


@dataclasses.dataclass(frozen=True, eq=False)
class ChainProposer:
    """The oracle's path as a chain: the true tokens, with the same wrong token at `wrong_at`."""

    tree: OracleTreeProposer
    tap_layers: tuple[int, ...] = ()

    @property
    def num_draft(self) -> int:
        return self.tree.depth

    def init_state(self, batch, slots, dtype):
        return None

    def observe(self, params, drafter_state, tokens, taps, positions, count):
        return None

    def propose(self, params, target_params, state, keys):
        tree, _ = self.tree.propose(params, target_params, state, keys)
        return tree.tokens[:, 1::2], None


@dataclasses.dataclass(frozen=True, eq=False)
class WithDFlashContext:
    """Drafts from a table oracle (parameters[0]) while a DFlash drafter (parameters[1]) observes what the
    step commits, so its context cache shows the target features the step hands a drafter."""

    drafts: object
    dflash: object

    @property
    def num_draft(self) -> int:
        return self.drafts.num_draft

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.dflash.tap_layers

    def init_state(self, batch, slots, dtype):
        return self.dflash.init_state(batch, slots, dtype)

    def observe(self, params, drafter_state, tokens, taps, positions, count):
        return self.dflash.observe(params[1], drafter_state, tokens, taps, positions, count)

    def propose(self, params, target_params, state, keys):
        return self.drafts.propose(params[0], target_params, state, keys)


@pytest.mark.parametrize("wrong_at", [None, 3])
def test_compacted_cache_equals_the_chain_cache(target, wrong_at):
    """After one step, the K/V of the committed tokens sit in the same slots with the same values whether
    the path was verified inside a tree (and gathered) or as a chain; so does the DFlash drafter's context
    (the accepted path's target features, projected)."""
    depth, b, p = 5, len(PROMPTS), 16
    expected, table = greedy_table(target, PROMPTS, 20)
    tokens = np.zeros((b, p), np.int32)
    for r, ids in enumerate(PROMPTS):
        tokens[r, : len(ids)] = ids
    lens = jnp.asarray([len(x) for x in PROMPTS], jnp.int32)
    sampling = SamplingParams.make()
    tree = OracleTreeProposer(depth, target.config.vocab_size, wrong_at)
    dflash = load_drafter("untrained", target, block_size=4)
    params = (table, dflash.params)

    def one_step(drafts):
        proposer = WithDFlashContext(drafts, dflash.proposer)
        state = prefill(
            target.module,
            target.params,
            jnp.asarray(tokens),
            lens,
            KVCache.init(target.config, b, 64, jnp.float32),
            jnp.full((b,), 20),
            jax.vmap(jax.random.key)(jnp.arange(b, dtype=jnp.uint32)),
            jnp.asarray([-1], jnp.int32),
            sampling,
            params,
            max_tokens=20,
            proposer=proposer,
        )
        return decode_step(target.module, target.params, state, sampling, params, proposer)

    from_tree, from_chain = one_step(tree), one_step(ChainProposer(tree))
    count = wrong_at or depth + 1  # the last token and the accepted drafts
    np.testing.assert_array_equal(from_tree.cache.lengths, lens + count)
    np.testing.assert_array_equal(from_chain.cache.lengths, from_tree.cache.lengths)
    np.testing.assert_array_equal(from_tree.drafter_state.lengths, from_tree.cache.lengths)
    np.testing.assert_array_equal(from_chain.drafter_state.lengths, from_tree.cache.lengths)
    np.testing.assert_array_equal(from_tree.num_generated, from_chain.num_generated)
    for tree_cache, chain_cache in [(from_tree.cache, from_chain.cache),
                                    (from_tree.drafter_state, from_chain.drafter_state)]:  # fmt: skip
        for k_tree, k_chain, v_tree, v_chain in zip(tree_cache.k, chain_cache.k, tree_cache.v, chain_cache.v):
            for r in range(b):
                filled = int(tree_cache.lengths[r])
                close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
                close(k_tree[r, :, :filled], k_chain[r, :, :filled])
                close(v_tree[r, :, :filled], v_chain[r, :, :filled])


def test_sampled_drafts_in_a_tree_are_refused(target):
    @dataclasses.dataclass(frozen=True, eq=False)
    class SampledTree(OracleTreeProposer):
        def propose(self, params, target_params, state, keys):
            tree, _ = super().propose(params, target_params, state, keys)
            return tree, jnp.zeros(tree.tokens.shape + (self.vocab,))

    oracle = TableDrafter(jnp.zeros((1, 64), jnp.int32), SampledTree(2, target.config.vocab_size))
    with pytest.raises(ValueError, match="drafts chosen without sampling"):
        greedy(target, [[5, 6]], 8, oracle, batch_size=1)


# --- sampling on the toy target ---------------------------------------------------------------------------

SETTINGS = {"t1": dict(temperature=1.0), "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9)}


@pytest.fixture(scope="module")
def toy():
    return make_toy()


@dataclasses.dataclass(frozen=True, eq=False)
class TopTwoTreeProposer:
    """A binary tree of depth 2 from the target itself: the root's top-2 tokens and each one's top-2
    (6 nodes), so drafts are often accepted and every path length occurs."""

    module: Transformer
    num_draft: int = 6
    tap_layers: tuple[int, ...] = ()

    def init_state(self, batch, slots, dtype):
        return None

    def observe(self, params, drafter_state, tokens, taps, positions, count):
        return None

    def _logits(self, target_params, state, nodes, parents):
        mask = ancestor_mask(parents)
        positions = state.cache.lengths[:, None] + depths(mask)
        hidden, _, _ = self.module.apply(target_params, nodes, positions, state.cache, mask)
        return self.module.apply(target_params, hidden, method=Transformer.logits)  # [B, nodes, V]

    def propose(self, params, target_params, state, keys):
        b = state.last_token.shape[0]
        root = state.last_token[:, None]
        first = jax.lax.top_k(self._logits(target_params, state, root, jnp.full((b, 1), -1)), 2)[1][:, 0]
        level1 = jnp.concatenate([root, first], axis=1)  # [B, 3]
        parents1 = jnp.broadcast_to(jnp.asarray([-1, 0, 0]), (b, 3))
        second = jax.lax.top_k(self._logits(target_params, state, level1, parents1)[:, 1:], 2)[1]  # [B, 2, 2]
        tokens = jnp.concatenate([first, second.reshape(b, 4)], axis=1).astype(jnp.int32)
        return DraftTree(tokens, jnp.broadcast_to(jnp.asarray([0, 0, 1, 1, 2, 2]), (b, 6))), None


@pytest.mark.parametrize("name", SETTINGS)
def test_tree_sampling_is_lossless(toy, name):
    observed, hist = sample_outcomes(toy, TopTwoTreeProposer(toy.module), SETTINGS[name])
    exact = exact_joint(toy, lambda logits: target_probs(logits, **SETTINGS[name]))
    p_value, total_variation = compare(observed, exact)
    assert p_value > 1e-3 and total_variation < TV_BOUND, f"p={p_value:.3g} TV={total_variation:.4f}"
    steps = hist.sum()
    assert hist[3] > 0.3 * steps and hist[1:4].min() > 0.02 * steps, f"accept histogram {hist}"


def _fresh_sample_where_the_walk_stops(key, tree, root_tokens, target_logits, params):
    """WRONG: the walk as `accept_tree`, but the committed last token is a second, fresh draw at the node
    where it stopped (which favours the children: their tokens can come out of either draw)."""
    acc, path = accept_tree(key, tree, root_tokens, target_logits, params)
    fresh = jnp.take_along_axis(sample(split_keys(key)[1], target_logits, params), path, axis=1)
    last = jnp.arange(fresh.shape[1]) == acc.num_accepted[:, None]
    return acc.replace(tokens=jnp.where(last, fresh, acc.tokens)), path


def test_a_wrong_tree_rule_is_caught(toy, monkeypatch):
    settings = SETTINGS["t1"]
    monkeypatch.setattr(decode, "accept_tree", _fresh_sample_where_the_walk_stops)
    observed, _ = sample_outcomes(toy, TopTwoTreeProposer(toy.module), settings)
    p_value, total_variation = compare(observed, exact_joint(toy, lambda lg: target_probs(lg, **settings)))
    assert p_value < 1e-9, f"wrong tree rule passed: p={p_value:.3g} TV={total_variation:.4f}"
