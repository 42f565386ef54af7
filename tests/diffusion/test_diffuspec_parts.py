"""DiffuSpec's parts on hand-built inputs: the lattice's mass and EOS rules, CPS against plain-Python
searches (a brute force over every path, and a beam written from the paper), ADL's published update on a
scripted sequence of lengths, the refinement schedule, and the markers that stop acceptance."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffusion_lms import TableDiffusionLM

from dflax.diffusion.adl import AdlSettings, AdlState, next_draft_length, update
from dflax.diffusion.cps import cps_path, history_trigram
from dflax.diffusion.lattice import token_lattice
from dflax.diffusion.refine import unmask_counts, window_log_probs
from dflax.drafters.dart_tree import UNSEEN
from dflax.drafters.diffuspec_proposer import NO_DRAFT_AFTER_EOS, NO_DRAFT_PAST_K, mark_unusable

EOS = 9


def log_probs(rows: list[list[dict[int, float]]], vocab: int = 10) -> jnp.ndarray:
    """[B, K, V] log probabilities from per-slot {token: probability} (the rest spread evenly)."""
    out = np.zeros((len(rows), len(rows[0]), vocab))
    for b, slots in enumerate(rows):
        for k, probs in enumerate(slots):
            rest = (1.0 - sum(probs.values())) / max(vocab - len(probs), 1)
            out[b, k] = [probs.get(v, rest) for v in range(vocab)]
    return jnp.log(jnp.asarray(out, jnp.float32))


def members(lattice, b, k) -> list[int]:
    return [int(t) for t, ok in zip(lattice.tokens[b, k], lattice.valid[b, k]) if ok]


def test_lattice_keeps_the_smallest_top_set_reaching_the_mass():
    lattice = token_lattice(
        log_probs(
            [
                [
                    {1: 0.85},  # one token reaches 0.8 alone
                    {1: 0.5, 2: 0.31, 3: 0.1},  # 0.5 + 0.31 reaches 0.8
                    {1: 0.5, 2: 0.29, 3: 0.15},  # needs the third
                    {v: 0.05 for v in range(9)} | {9: 0.55},  # 0.55 + 5 x 0.05 = 0.8: needs six
                ]
            ]
        ),
        jnp.asarray([EOS]),
        max_set=15,
    )
    assert [members(lattice, 0, k) for k in range(3)] == [[1], [1, 2], [1, 2, 3]]
    assert len(members(lattice, 0, 3)) in (6, 7)  # 0.8 reached at the sixth up to float rounding
    assert members(lattice, 0, 3)[0] == 9
    np.testing.assert_allclose(np.exp(lattice.log_q[0, 1, :2]), [0.5, 0.31], rtol=1e-5)
    assert int(lattice.length[0]) == 4  # no certain EOS


def test_lattice_caps_the_set_and_cuts_at_the_first_certain_eos():
    flat = {v: 0.1 for v in range(10)}
    lattice = token_lattice(
        log_probs(
            [
                [flat, {EOS: 0.5, 4: 0.4}, {EOS: 0.9}, {5: 0.9}],  # EOS kept as a member; certain at 2
                [{EOS: 0.95}, {5: 0.9}, {EOS: 0.9}, {5: 0.9}],  # certain EOS at slot 0
            ]
        ),
        jnp.asarray([EOS, 8]),
        max_set=4,
    )
    assert len(members(lattice, 0, 0)) == 4  # capped
    assert members(lattice, 0, 1) == [EOS, 4]
    assert members(lattice, 0, 2) == [EOS]
    assert lattice.length.tolist() == [3, 1]  # up to and including the first certain EOS


def test_lattice_treats_a_set_of_several_eos_ids_as_certain():
    lattice = token_lattice(log_probs([[{1: 0.9}, {EOS: 0.5, 8: 0.45}]]), jnp.asarray([EOS, 8]))
    assert members(lattice, 0, 1) == [EOS, 8]
    assert lattice.length.tolist() == [2]


def python_prior(text: list[int], context: tuple[int, int], token: int) -> float:
    """count(context + token) / count(context followed by anything) in the text, 0 when unseen."""
    grams = [tuple(text[i : i + 3]) for i in range(len(text) - 2)]
    total = sum(g[:2] == context for g in grams)
    return sum(g == (*context, token) for g in grams) / total if total else 0.0


def python_score(path, sets, text, weight=0.5) -> float:
    """A path's CPS score: per slot (1 - w) log q + w log(p + 1e-10), context = the two tokens before."""
    seq, score = list(text), 0.0
    for token, slot in zip(path, sets):
        p = python_prior(text, (seq[-2], seq[-1]), token)
        score += (1 - weight) * math.log(slot[token]) + weight * math.log(p + UNSEEN)
        seq.append(token)
    return score


def python_beam(sets, text, width, weight=0.5):
    """The paper's beam in plain Python: keep the `width` best partial paths per slot (ties: the earlier
    parent, then the more likely token)."""
    beam = [((), 0.0)]
    for k, slot in enumerate(sets):
        children = []
        for path, _ in beam:
            for token in sorted(slot, key=lambda t: -slot[t]):
                children.append((path + (token,), python_score(path + (token,), sets[: k + 1], text, weight)))
        children.sort(key=lambda c: -c[1])  # stable: earlier parent and column first on ties
        beam = children[:width]
    return beam[0]


def random_case(rng, slots=4, vocab=6):
    """Slot sets of 1-3 members over a small vocabulary (mass 0.85, every member needed to reach 0.8) and
    a text whose trigrams favour some paths."""
    sets = []
    for _ in range(slots):
        size = int(rng.integers(1, 4))
        tokens = rng.choice(vocab, size, replace=False)
        probs = np.linspace(1.0, 0.6, size) + rng.uniform(0, 0.05, size)  # descending, no ties
        probs *= (0.85 if size > 1 else 0.95) / probs.sum()
        sets.append({int(t): float(p) for t, p in zip(tokens, probs)})
    text = [int(t) for t in rng.integers(0, vocab, 24)]
    return sets, text


def lattice_of(cases, vocab=6):
    """Lattices of several cases at once (one row each)."""
    rows = [[dict(s) for s in sets] for sets, _ in cases]
    lattice = token_lattice(log_probs(rows, vocab), jnp.asarray([-5]), max_set=vocab)
    for b, (sets, _) in enumerate(cases):
        for k, slot in enumerate(sets):
            assert sorted(members(lattice, b, k)) == sorted(slot), "the case is not the lattice it means"
    text = jnp.asarray([t for _, t in cases], jnp.int32)
    return lattice, text


def test_history_trigram_counts_equal_python():
    rng = np.random.default_rng(3)
    text = rng.integers(0, 3, (2, 20)).astype(np.int32)
    length = np.asarray([20, 11], np.int32)
    context = rng.integers(0, 3, (2, 4, 2)).astype(np.int32)
    tokens = rng.integers(0, 3, (2, 4, 3)).astype(np.int32)
    counts, totals = history_trigram(*map(jnp.asarray, (text, length, context, tokens)))
    for b in range(2):
        grams = [tuple(text[b, i : i + 3]) for i in range(length[b] - 2)]
        for w in range(4):
            ctx = tuple(context[b, w])
            assert totals[b, w] == sum(g[:2] == ctx for g in grams)
            for m in range(3):
                assert counts[b, w, m] == sum(g == (*ctx, tokens[b, w, m]) for g in grams)


def test_cps_with_a_wide_beam_returns_the_brute_force_best_path():
    rng = np.random.default_rng(0)
    cases = [random_case(rng) for _ in range(16)]
    lattice, text = lattice_of(cases)
    paths, scores = cps_path(lattice, text, jnp.full((16,), 24, jnp.int32), beam_width=27)
    for b, (sets, seq) in enumerate(cases):
        every = {p: python_score(p, sets, seq) for p in itertools.product(*[list(s) for s in sets])}
        best = max(every.values())
        assert every[tuple(paths[b].tolist())] == pytest.approx(best, abs=1e-3), b
        assert float(scores[b]) == pytest.approx(best, abs=1e-3)


def test_cps_beam_of_three_equals_the_python_beam():
    rng = np.random.default_rng(1)
    cases = [random_case(rng, slots=5) for _ in range(16)]
    lattice, text = lattice_of(cases)
    paths, scores = cps_path(lattice, text, jnp.full((16,), 24, jnp.int32), beam_width=3)
    for b, (sets, seq) in enumerate(cases):
        path, score = python_beam(sets, seq, 3)
        assert tuple(paths[b].tolist()) == path, b
        assert float(scores[b]) == pytest.approx(score, abs=1e-3)


def test_cps_prefers_the_causal_path_over_the_per_slot_argmax():
    """Slot 1's argmax (3) never followed 1 2 in the text; the second choice (4) did: CPS drafts 2 4."""
    text = [7, 1, 2, 4, 7, 1]
    sets = [{2: 0.6, 5: 0.3}, {3: 0.5, 4: 0.4}]
    lattice = token_lattice(log_probs([sets], 10), jnp.asarray([EOS]))
    paths, _ = cps_path(lattice, jnp.asarray([text]), jnp.asarray([6]))
    assert paths[0].tolist() == [2, 4]
    assert jnp.argmax(lattice.log_q[0, :, 0]) == 0 and lattice.tokens[0, 1, 0] == 3  # argmax would be 2 3


def test_cps_past_a_certain_eos_takes_each_slots_top_token_and_scores_nothing():
    sets = [{1: 0.9}, {EOS: 0.95}, {3: 0.5, 4: 0.4}]
    lattice = token_lattice(log_probs([sets], 10), jnp.asarray([EOS]))
    paths, score = cps_path(lattice, jnp.asarray([[5, 6, 7]]), jnp.asarray([3]))
    assert paths[0].tolist() == [1, EOS, 3]
    assert float(score[0]) == pytest.approx(python_score((1, EOS), sets[:2], [5, 6, 7]), abs=1e-3)


def test_adl_follows_the_published_update_on_scripted_lengths():
    settings = AdlSettings(k_min=20, k_max=30)
    script = [(30, 30), (30, 4), (25, 3), (12, 12), (8, 2), (20, 20), (30, 30), (14, 30)]  # (L_gen, L_acc)
    state = AdlState.init(1, settings)
    gen = acc = 30.0
    ks = [int(next_draft_length(state, settings)[0])]
    for l_gen, l_acc in script:
        state = update(state, jnp.asarray([l_gen]), jnp.asarray([l_acc]), jnp.asarray([True]), settings)
        gen, acc = 0.5 * gen + 0.5 * l_gen, 0.5 * acc + 0.5 * l_acc
        expected = min(max(math.floor(gen) + 10 * (acc >= gen), 20), 30)
        np.testing.assert_allclose([state.avg_gen[0], state.avg_acc[0]], [gen, acc], rtol=1e-6)
        ks.append(int(next_draft_length(state, settings)[0]))
        assert ks[-1] == expected
    # The script reaches both clip bounds, k below them without the bonus (27, 23) and with it (18 + 10).
    assert ks == [30, 30, 30, 27, 20, 20, 20, 23, 28]


def test_adl_leaves_inactive_rows_and_honours_other_bounds():
    settings = AdlSettings(k_min=3, k_max=8)
    state = AdlState.init(2, settings)
    state = update(state, jnp.asarray([2, 2]), jnp.asarray([1, 1]), jnp.asarray([True, False]), settings)
    assert next_draft_length(state, settings).tolist() == [5, 8]  # floor(5) + 0; untouched: 8 + 10 -> 8
    with pytest.raises(ValueError, match="k_min <= k_max"):
        AdlSettings(k_min=9, k_max=8)


def test_refinement_fixes_every_slot_but_the_last_forwards():
    assert unmask_counts(30, 1) == []
    assert unmask_counts(10, 3) == [4, 3]  # ceil(10/3)=4, ceil(20/3)-4=3, the last forward: 3 left
    assert sum(unmask_counts(7, 7)) == 6


def test_markers_stop_at_k_and_after_the_first_eos():
    drafts = jnp.asarray([[1, 2, 3, 4, 5], [1, EOS, 3, 4, 5], [1, 2, 3, EOS, 5]])
    marked = mark_unusable(drafts, jnp.asarray([3, 5, 4]), jnp.asarray([EOS]))
    x, e = NO_DRAFT_PAST_K, NO_DRAFT_AFTER_EOS
    assert marked.tolist() == [[1, 2, 3, x, x], [1, EOS, e, e, e], [1, 2, 3, EOS, e]]


def test_refinement_fixes_the_most_confident_slots_then_scores_the_rest():
    model = TableDiffusionLM(12, window=4)
    params = model.make_params(5, 2.0)
    last, length = jnp.asarray([3, 7]), jnp.asarray([5, 9])
    got = window_log_probs(model, params, None, last, length, window=4, steps=2)
    masks = jnp.zeros((2, 4), jnp.int32)  # mask_token_id 0
    first = jax.nn.log_softmax(model.window_logits(params, None, last, length, masks), axis=-1)
    for b in range(2):
        confident = np.argsort(-np.asarray(first[b].max(axis=-1)), kind="stable")[:2]  # unmask_counts(4, 2)
        window = np.zeros(4, np.int32)
        window[confident] = np.asarray(first[b].argmax(axis=-1))[confident]
        second = jax.nn.log_softmax(
            model.window_logits(params, None, last[b : b + 1], length[b : b + 1], jnp.asarray(window[None])),
            -1,
        )[0]
        for j in range(4):
            if j in confident:
                assert int(jnp.argmax(got[b, j])) == window[j] and float(got[b, j, window[j]]) == 0.0
                assert float(jnp.sort(got[b, j])[-2]) < -1e29  # one-hot
            else:
                np.testing.assert_allclose(got[b, j], second[j], rtol=1e-5, atol=1e-5)


def test_a_wider_diffusion_vocabulary_drafts_only_target_ids():
    model = TableDiffusionLM(12, window=3)
    params = model.make_params(6, 2.0).at[..., 10:].add(50.0)  # ids 10, 11 would win everywhere
    got = window_log_probs(model, params, None, jnp.asarray([1]), jnp.asarray([4]), 3, 1, vocab_size=10)
    assert got.shape == (1, 3, 10)
    np.testing.assert_allclose(jnp.exp(got).sum(-1), 1.0, rtol=1e-5)
