"""The DFlash objective and trainer on a tiny target: masks, loss weights, overfitting, exact resume, export.

The overfit run trains on the tiny target's own greedy continuations, validates on held-out ones and
exports a drafter, which must then decode losslessly and faster (tau > 1) through `dflax.generate`.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console
from rich.progress import Progress
from tiny_training import TINY, greedy_sequences, random_prompts, write_data_dir
from typer.testing import CliRunner

import dflax
from dflax.cli import app
from dflax.drafters import load_drafter, measured_acceptance, shipped_drafter_path
from dflax.drafters.dflash import DFlashDrafter, DFlashProposer, init_drafter_params
from dflax.drafters.draft_vocab import frequent_tokens
from dflax.models.cache import KVCache
from dflax.models.transformer import Transformer
from dflax.target import weights_fingerprint
from dflax.train import objective, steps
from dflax.train.batches import PaddedSequences, batch_index, pad_sequences
from dflax.train.features import DeviceFeatures, FeatureCache, cache_features
from dflax.train.report import METRICS, PLOT, TRAINING_RECORD
from dflax.train.steps import feature_program
from dflax.train.trainer import TrainConfig, train
from dflax.train.tree_acceptance import TREE_NODES
from dflax.train.warm_start import resolve_drafter_dir, warm_start_params

RECIPE = Path(__file__).parents[2] / "configs/train/dflash-smollm2.json"
QUIET = Console(quiet=True)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(48, seed=0)


@pytest.fixture(scope="module")
def sequences(target, prompts):
    """48 (ids, prompt_len) pairs: random prompts + the target's greedy continuation (40 tokens)."""
    return greedy_sequences(target, prompts)


def tiny_proposer(target, block_size=8, num_layers=2):
    config = dataclasses.replace(TINY, block_size=block_size, num_layers=num_layers).drafter_config(target)
    module = DFlashDrafter(config, jnp.float32, "reference")
    return DFlashProposer(module, target.module, block_size), init_drafter_params(module, seed=1)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _block_logits(proposer, params, target_params, features, blocks, chunk):
    hidden = objective.block_hidden(proposer, params, target_params, features, blocks, chunk)  # [R, B, D]
    return proposer.target.apply(target_params, hidden[:, 1:], method=Transformer.logits)  # [R, n, V]


def block_logits(proposer, params, target, features, blocks, chunk=2):
    """[R, n, V] logits of the blocks through the training forward (all anchors of a sequence at once)."""
    return np.asarray(_block_logits(proposer, params, target.params, features, blocks, chunk))


def per_anchor_hidden(proposer, params, target_params, features, blocks):
    """The oracle: the decoding forward, one block per row over its own copy of the sequence's context cut
    at the anchor (the objective before all anchors shared one forward)."""
    num_seqs, max_len, _ = features.shape
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (num_seqs, max_len))
    ks, vs = proposer.module.apply(params, features, positions, method=DFlashDrafter.context_kv)
    # [N, S, K, H] projections -> the cache's head-major [R, K, S, H], one copy per anchor row.
    per_row = lambda x: jnp.repeat(jnp.swapaxes(x, 1, 2), blocks.anchors.shape[0] // num_seqs, axis=0)  # noqa: E731
    context = KVCache(k=tuple(map(per_row, ks)), v=tuple(map(per_row, vs)), lengths=blocks.anchors)
    return proposer.draft_hidden(params, target_params, blocks.tokens, blocks.anchors, context)  # [R, B, D]


def per_anchor_loss(proposer, params, target_params, features, blocks, weights):
    """The oracle's weighted loss and [R, n] greedy correctness."""
    hidden = per_anchor_hidden(proposer, params, target_params, features, blocks)
    logits = proposer.target.apply(target_params, hidden[:, 1:], method=Transformer.logits)  # [R, n, V]
    picked = jnp.take_along_axis(logits, blocks.labels[..., None], -1)[..., 0]
    ce = jax.nn.logsumexp(logits, -1) - picked  # [R, n]
    w = weights[None] * blocks.valid
    return jnp.sum(w * ce) / jnp.sum(w), jnp.argmax(logits, -1) == blocks.labels


features_of = jax.jit(objective.target_features, static_argnums=(0, 4, 5))
loss_of = jax.jit(objective.dflash_loss, static_argnums=(0, 6, 7))


def padded_features(target, tokens, lengths, taps):
    """[N, S, K * D] features of padded sequences through the prefill path (zero past each length)."""
    n, s = tokens.shape
    packed = np.asarray(features_of(target.module, target.params, jnp.asarray(tokens), jnp.asarray(lengths),
                                    taps, n * s))  # fmt: skip
    out = np.zeros((n, s, packed.shape[-1]), packed.dtype)
    start = 0
    for i, length in enumerate(np.asarray(lengths)):
        out[i, :length] = packed[start : start + length]
        start += length
    return jnp.asarray(out)


def test_block_sees_only_context_before_its_anchor_and_no_other_block(target):
    proposer, params = tiny_proposer(target)
    s, n = 40, 7
    width = len(proposer.tap_layers) * target.config.hidden_size
    features = jax.random.normal(jax.random.key(0), (1, s, width))  # one sequence, [1, S, K * D]
    anchors = jnp.asarray([10, 25, 3], jnp.int32)
    blocks = objective.Blocks(
        anchors=anchors,
        tokens=jnp.asarray([17, 99, 5], jnp.int32),
        labels=jnp.zeros((3, n), jnp.int32),
        valid=jnp.ones((3, n), bool),
    )
    base = block_logits(proposer, params, target, features, blocks)  # [3, n, V]

    def perturbed(position):
        return block_logits(proposer, params, target, features.at[0, position].add(1.0), blocks)

    for position in (10, 11, 30, 39):  # at or after anchor 10: row 0 must not change
        np.testing.assert_array_equal(perturbed(position)[0], base[0])
    for position in (0, 9):  # before the anchor: row 0 changes
        assert np.abs(perturbed(position)[0] - base[0]).max() > 1e-3
    changed = perturbed(20)  # between anchors 10 and 25: only the block at 25 sees it
    np.testing.assert_array_equal(changed[[0, 2]], base[[0, 2]])
    assert np.abs(changed[1] - base[1]).max() > 1e-3
    # Another block's anchor token and position leave row 0 alone.
    other = blocks.replace(anchors=anchors.at[1].set(33), tokens=blocks.tokens.at[1].set(200).at[2].set(201))
    np.testing.assert_array_equal(block_logits(proposer, params, target, features, other)[0], base[0])


@pytest.mark.parametrize("stride", [0, 1])
def test_all_anchors_in_one_forward_equal_the_per_anchor_objective(target, stride):
    """Loss, per-position correctness and gradients of the one-forward objective equal those of one decoding
    forward per anchor (each over its own copy of the context cut at the anchor), dense anchors included."""
    proposer, params = tiny_proposer(target)
    n, s = 7, 48
    rng = np.random.default_rng(4)
    tokens = rng.integers(3, 256, (2, s)).astype(np.int32)
    prompt_lens, lengths = jnp.asarray([5, 9], jnp.int32), jnp.asarray([40, 48], jnp.int32)
    # 37 anchors: at stride 1 every response position of sequence 0 (34 candidates: 3 rows unused).
    key = jax.random.key(2)
    blocks = objective.make_blocks(key, jnp.asarray(tokens), prompt_lens, lengths, 37, n, stride)
    assert not np.asarray(blocks.valid).all()
    features = padded_features(target, tokens, lengths, proposer.tap_layers)
    weights = objective.position_weights(8, 4.0)

    def one_forward(p):
        return objective.dflash_loss(proposer, p, target.params, features, blocks, weights, 16, 5)

    def per_anchor(p):
        return per_anchor_loss(proposer, p, target.params, features, blocks, weights)

    (loss, stats), grads = jax.jit(jax.value_and_grad(one_forward, has_aux=True))(params)
    (expected, correct), expected_grads = jax.jit(jax.value_and_grad(per_anchor, has_aux=True))(params)
    np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(stats.correct, (np.asarray(correct) & np.asarray(blocks.valid)).sum(0))
    accuracy = objective.position_accuracy(stats)
    np.testing.assert_allclose(accuracy, (correct & blocks.valid).sum(0) / blocks.valid.sum(0), atol=1e-6)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(expected_grads))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * scale), grads, expected_grads)


def test_bfloat16_compute_tracks_the_float32_step(target):
    """compute_dtype "bfloat16": the loss and the float32 master gradients follow the float32 step's
    within bf16 rounding (the products run on bf16 copies of the weights and features)."""
    proposer, params = tiny_proposer(target)
    rng = np.random.default_rng(6)
    tokens = rng.integers(3, 256, (2, 48)).astype(np.int32)
    lengths = np.asarray([40, 48], np.int32)
    batch = {
        "tokens": tokens,
        "prompt_lens": np.asarray([5, 9], np.int32),
        "lengths": lengths,
        "features": padded_features(target, tokens, lengths, proposer.tap_layers).astype(jnp.bfloat16),
    }
    config = dataclasses.replace(TINY, anchors_per_seq=12)

    def step(dtype):
        loss_fn = steps.dflash_loss_fn(proposer, config, dtype)
        grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        return grad(params, target.params, batch, jax.random.key(0))

    (loss32, _), grads32 = step("float32")
    (loss16, _), grads16 = step("bfloat16")
    np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
    assert loss16 != loss32  # the bf16 step does round
    flat32, flat16 = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(t)]) for t in (grads32, grads16))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads16))
    cosine = flat16 @ flat32 / (np.linalg.norm(flat16) * np.linalg.norm(flat32))
    assert cosine > 0.99, cosine
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainConfig(compute_dtype="float16")


def test_a_batch_cut_to_its_length_bucket_gives_the_full_width_loss(target):
    """length_bucket: a batch cut to its longest sequence (rounded up to the bucket) trains on the same
    blocks as the max_seq_len batch (anchors at a stride do not depend on the width) with the same loss."""
    proposer, params = tiny_proposer(target)
    rng = np.random.default_rng(7)
    max_len, lengths = 64, np.asarray([30, 17, 64, 21], np.int32)
    tokens = rng.integers(3, 256, (4, max_len)).astype(np.int32) * (np.arange(max_len) < lengths[:, None])
    data = PaddedSequences(tokens, np.asarray([4, 6, 5, 3], np.int32), lengths)
    packed = padded_features(target, tokens, lengths, proposer.tap_layers).astype(jnp.bfloat16)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.concatenate([np.asarray(packed[i, :n]) for i, n in enumerate(lengths)]).view(np.uint16)
    features = FeatureCache(flat, offsets)
    assert [data.width(np.asarray(i), 16) for i in ([0, 1], [1, 3], [0, 2], [1, -1])] == [32, 32, 64, 32]
    assert data.width(np.asarray([0, 1]), 0) == max_len
    config = dataclasses.replace(TINY, anchors_per_seq=12, anchor_stride=2, length_bucket=16)
    loss_fn = jax.jit(steps.dflash_loss_fn(proposer, config))
    index = np.asarray([0, 1])
    cut = data.take(index, features, data.width(index, config.length_bucket))
    assert cut["tokens"].shape == (2, 32) and cut["features"].shape[:2] == (2, 32)
    full = data.take(index, features)
    key = jax.random.key(0)
    (loss_cut, _), (loss_full, _) = (loss_fn(params, target.params, b, key) for b in (cut, full))
    np.testing.assert_allclose(loss_cut, loss_full, rtol=1e-5)
    with pytest.raises(ValueError, match="length_bucket"):
        TrainConfig(length_bucket=-1)


def test_dense_anchors_at_a_stride_cover_the_response():
    key = jax.random.key(0)
    every, used = objective.sample_anchors(key, jnp.int32(5), jnp.int32(30), 64, 40, stride=1)
    np.testing.assert_array_equal(every[used], np.arange(5, 29))  # all 24 candidates, in order
    third, used = objective.sample_anchors(key, jnp.int32(5), jnp.int32(30), 64, 40, stride=3)
    assert set(np.diff(third[used])) == {3} and 5 <= third[0] < 8 and third[used].max() <= 28
    offsets = {int(objective.sample_anchors(jax.random.key(i), 5, 30, 64, 4, 3)[0][0]) for i in range(20)}
    assert offsets == {5, 6, 7}  # the offset varies with the key, so every position gets trained


def test_target_features_through_the_packed_prefill_equal_a_plain_forward(target):
    """Packed rows of mixed lengths give each real token the taps of an unpadded forward of its sequence."""
    taps = (0, 2)
    rng = np.random.default_rng(5)
    lengths = np.asarray([9, 0, 14, 3], np.int32)  # an unused row in the middle
    tokens = rng.integers(3, 256, (4, 16)).astype(np.int32)
    packed = np.asarray(features_of(target.module, target.params, jnp.asarray(tokens), jnp.asarray(lengths),
                                    taps, 32))  # fmt: skip
    start = 0
    for row, length in enumerate(lengths):
        if length:
            ids = jnp.asarray(tokens[row : row + 1, :length])
            positions = jnp.arange(length, dtype=jnp.int32)[None]
            cache = KVCache.init(target.config, 1, int(length), jnp.float32)
            causal = jnp.tril(jnp.ones((1, length, length), jnp.bool_))
            _, _, plain = target.module.apply(target.params, ids, positions, cache, causal, taps)
            expected = np.concatenate([np.asarray(t[0]) for t in plain], -1)  # [length, K * D]
            np.testing.assert_allclose(packed[start : start + length], expected, rtol=1e-5, atol=1e-5)
        start += length


def test_bfloat16_features_are_the_bfloat16_targets_prefill(target, tiny_checkpoint):
    """feature_dtype "bfloat16" runs the float32-loaded target as a bf16 load of it would run."""
    taps, pack = (0, 2), 32
    tokens = jnp.asarray(np.random.default_rng(6).integers(3, 256, (2, 16)), jnp.int32)
    lengths = jnp.asarray([16, 11], jnp.int32)
    bf16 = dflax.load_target(str(tiny_checkpoint("qwen3")[0]), dtype="bfloat16")
    expected = features_of(bf16.module, bf16.params, tokens, lengths, taps, pack)[:27]
    got = feature_program(target.module, taps, pack, "bfloat16")(target.params, tokens, lengths)[:27]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
    full = np.asarray(feature_program(target.module, taps, pack, "float32")(target.params, tokens, lengths))
    full = full[:27].astype(np.float32)
    assert not np.array_equal(np.asarray(got, np.float32), full)  # another forward, close to float32's
    np.testing.assert_allclose(np.asarray(got, np.float32), full, rtol=0.1, atol=0.1)


def test_position_weights_and_paper_gamma():
    np.testing.assert_allclose(objective.position_weights(16, 7.0), np.exp(-np.arange(15) / 7.0), rtol=1e-6)
    assert [objective.default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    with pytest.raises(ValueError, match="gamma"):
        objective.default_gamma(12)
    assert TrainConfig(block_size=12, gamma=6.0).loss_gamma == 6.0


def test_anchors_lie_in_the_response_distinct_and_deterministic():
    key = jax.random.key(3)
    anchors, used = objective.sample_anchors(key, jnp.int32(5), jnp.int32(30), 64, 16)
    assert used.all() and len(set(anchors.tolist())) == 16
    assert anchors.min() >= 5 and anchors.max() <= 28  # the last anchor still has a token after it
    again, _ = objective.sample_anchors(key, jnp.int32(5), jnp.int32(30), 64, 16)
    np.testing.assert_array_equal(anchors, again)
    few, used = objective.sample_anchors(key, jnp.int32(5), jnp.int32(9), 64, 16)  # 3 candidates
    assert sorted(few[used].tolist()) == [5, 6, 7] and used.sum() == 3


def test_loss_weights_and_masking_beyond_the_sequence_end(target):
    proposer, params = tiny_proposer(target)
    n, s = 7, 32
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 256, (2, s)).astype(np.int32)
    prompt_lens, lengths = jnp.asarray([4, 6], jnp.int32), jnp.asarray([20, 32], jnp.int32)
    blocks = objective.make_blocks(jax.random.key(0), jnp.asarray(tokens), prompt_lens, lengths, 8, n)
    anchors = np.asarray(blocks.anchors).reshape(2, 8)
    expected_valid = (anchors[:, :, None] + np.arange(1, n + 1)) < np.asarray(lengths)[:, None, None]
    np.testing.assert_array_equal(blocks.valid, expected_valid.reshape(16, n))
    assert not expected_valid.all()  # some blocks run past the end of sequence 0
    for r, a in enumerate(blocks.anchors.tolist()):  # labels: position k predicts token a + k, no shift
        k = np.flatnonzero(blocks.valid[r])
        np.testing.assert_array_equal(blocks.labels[r, k], tokens[r // 8, a + 1 + k])

    features = padded_features(target, tokens, lengths, proposer.tap_layers)
    weights = objective.position_weights(8, 4.0)
    loss, stats = loss_of(proposer, params, target.params, features, blocks, weights, 5, 3)  # chunks padded
    logits = block_logits(proposer, params, target, features, blocks)
    ce = (
        jax.nn.logsumexp(logits, -1)
        - np.take_along_axis(logits, np.asarray(blocks.labels)[..., None], -1)[..., 0]
    )
    w = np.asarray(weights)[None] * np.asarray(blocks.valid)
    np.testing.assert_allclose(loss, (w * ce).sum() / w.sum(), rtol=1e-5)
    np.testing.assert_array_equal(stats.valid, np.asarray(blocks.valid).sum(0))

    # Tokens past a sequence's end change neither the labels nor the loss (features are causal).
    tail = tokens.copy()
    tail[0, 20:] = 7
    features_t = padded_features(target, tail, lengths, proposer.tap_layers)
    blocks_t = objective.make_blocks(jax.random.key(0), jnp.asarray(tail), prompt_lens, lengths, 8, n)
    loss_t, _ = loss_of(proposer, params, target.params, features_t, blocks_t, weights, 5, 3)
    np.testing.assert_allclose(loss_t, loss, rtol=1e-6)


def test_draft_vocabulary_loss_reads_out_its_tokens_and_skips_the_others(target):
    proposer, params = tiny_proposer(target)
    n, s = 7, 32
    tokens = np.random.default_rng(2).integers(3, 256, (1, s)).astype(np.int32)
    blocks = objective.make_blocks(
        jax.random.key(0), jnp.asarray(tokens), jnp.asarray([4]), jnp.asarray([s]), 8, n
    )
    vocab = np.unique(np.asarray(blocks.labels))[::2].astype(np.int32)  # half of the labels' tokens
    pruned = dataclasses.replace(proposer, draft_vocab=vocab)
    features = padded_features(target, tokens, np.asarray([s]), proposer.tap_layers)
    weights = objective.position_weights(8, 4.0)
    loss, stats = loss_of(pruned, params, target.params, features, blocks, weights, 5, 3)

    logits = block_logits(proposer, params, target, features, blocks)[..., vocab]  # [R, n, V']
    labels = np.asarray(blocks.labels)
    inside = np.isin(labels, vocab)
    assert inside.any() and not inside.all()
    index = np.searchsorted(vocab, np.where(inside, labels, vocab[0]))
    ce = jax.nn.logsumexp(logits, -1) - np.take_along_axis(logits, index[..., None], -1)[..., 0]
    w = np.asarray(weights)[None] * np.asarray(blocks.valid) * inside
    np.testing.assert_allclose(loss, (w * ce).sum() / w.sum(), rtol=1e-5)
    correct = inside & (logits.argmax(-1) == index)  # a label outside the vocabulary is a wrong draft
    np.testing.assert_array_equal(stats.correct, (correct & np.asarray(blocks.valid)).sum(0))


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_distill_weight_mixes_in_the_kl_from_the_targets_next_token_distribution(target, draft_vocab):
    """(1 - lambda) * ce + lambda * KL(p || q), p the target's softmax before each label (its own forward's
    logits, renormalised over a draft vocabulary), q the drafter's block logits."""
    proposer, params = tiny_proposer(target)
    n, s, lam = 7, 32, 0.3
    tokens = np.random.default_rng(5).integers(3, 256, (1, s)).astype(np.int32)
    blocks = objective.make_blocks(
        jax.random.key(1), jnp.asarray(tokens), jnp.asarray([4]), jnp.asarray([s]), 8, n
    )
    vocab = np.arange(target.config.vocab_size, dtype=np.int32)
    if draft_vocab:  # every label, and some other tokens
        vocab = np.union1d(np.asarray(blocks.labels), np.arange(3, 200, 3)).astype(np.int32)
        proposer = dataclasses.replace(proposer, draft_vocab=vocab)
    features = padded_features(target, tokens, np.asarray([s]), proposer.tap_layers)
    final = padded_features(target, tokens, np.asarray([s]), (target.config.num_layers - 1,))
    weights = objective.position_weights(8, 4.0)
    distill_loss = jax.jit(objective.dflash_loss, static_argnums=(0, 6, 7, 9))
    loss, stats = distill_loss(proposer, params, target.params, features, blocks, weights, 5, 3, final, lam)

    positions = jnp.arange(s, dtype=jnp.int32)[None]
    cache = KVCache.init(target.config, 1, s, target.dtype)
    hidden, _, _ = target.module.apply(target.params, jnp.asarray(tokens), positions, cache, None)
    target_logits = np.asarray(target.module.apply(target.params, hidden, method=Transformer.logits))[0]
    anchors, labels = np.asarray(blocks.anchors), np.asarray(blocks.labels)
    before = np.minimum(anchors[:, None] + np.arange(n), s - 1)  # past the end: weight 0
    log_p = jax.nn.log_softmax(target_logits[before][..., vocab])  # [R, n, V']
    logits = block_logits(proposer, params, target, features, blocks)[..., vocab]  # [R, n, V']
    log_q = jax.nn.log_softmax(logits)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), -1)
    index = np.searchsorted(vocab, labels)
    ce = -np.take_along_axis(np.asarray(log_q), index[..., None], -1)[..., 0]
    w = np.asarray(weights)[None] * np.asarray(blocks.valid)
    expected = (w * ((1 - lam) * ce + lam * kl)).sum() / w.sum()
    np.testing.assert_allclose(loss, expected, rtol=2e-5)
    # The ratio rule's chance to accept a draft sampled from q: sum min(p, q), summed over valid blocks.
    overlap = np.sum(np.minimum(np.exp(log_p), np.exp(log_q)), -1) * np.asarray(blocks.valid)
    np.testing.assert_allclose(stats.overlap, overlap.sum(0), rtol=1e-5)
    acc, tau = objective.sampled_acceptance(stats)
    np.testing.assert_allclose(acc, overlap.sum(0) / np.asarray(blocks.valid).sum(0), rtol=1e-5)
    assert float(tau) == pytest.approx(1 + np.cumprod(np.asarray(acc)).sum(), rel=1e-6)
    plain, plain_stats = distill_loss(
        proposer, params, target.params, features, blocks, weights, 5, 3, None, 0.0
    )
    np.testing.assert_allclose(plain, (w * ce).sum() / w.sum(), rtol=2e-5)
    assert abs(float(loss) - float(plain)) > 1e-3  # the KL term moves the loss
    assert not np.asarray(plain_stats.overlap).any()


def test_training_with_a_draft_vocabulary_and_distillation_exports_it(target, prompts, sequences, tmp_path):
    config = dataclasses.replace(TINY, steps=10, draft_vocab_size=64, validate_every=10, distill_weight=0.5)
    result = train(config, target, sequences[:32], sequences[32:], tmp_path, console=QUIET)
    assert all(np.isfinite(entry["loss"]) for entry in result.log if "loss" in entry)
    validation = [entry for entry in result.log if "val_tau" in entry]
    assert validation and all(1.0 <= entry["val_tau_t1"] <= 8.0 for entry in validation)
    drafter = load_drafter(result.drafter_dir, target)
    # The features hold the drafter's taps and the target's last layer, which only the loss reads.
    taps = len(drafter.config.target_layer_ids)
    width = np.load(tmp_path / "features/train.npy", mmap_mode="r").shape[1]
    assert width == (taps + 1) * target.config.hidden_size
    responses = [(ids[:64], p) for ids, p in sequences[:32]]  # as truncated to max_seq_len
    np.testing.assert_array_equal(drafter.proposer.draft_vocab, frequent_tokens(responses, 64, 256))
    plain = dflax.generate(target, prompts[32:36], max_new_tokens=16, batch_size=4)
    spec = dflax.generate(
        target,
        prompts[32:36],
        max_new_tokens=16,
        batch_size=4,
        drafter=drafter,
        block_size=drafter.trained_block_size,
    )
    assert [r.tokens for r in spec] == [r.tokens for r in plain]

    # A warm start on another slice keeps its parent's vocabulary with draft_vocab_from 'warm_start'
    # (the slice's own 64 most frequent tokens are another set).
    slice_ = sequences[32:40]
    own = frequent_tokens([(ids[:64], p) for ids, p in slice_], 64, 256)
    assert set(own) != set(drafter.proposer.draft_vocab)
    warm = dataclasses.replace(
        config, steps=1, init="drafter", init_from=str(result.drafter_dir), draft_vocab_from="warm_start"
    )
    child = train(warm, target, slice_, [], tmp_path / "child", console=QUIET)
    kept = load_drafter(child.drafter_dir, target).proposer.draft_vocab
    np.testing.assert_array_equal(kept, drafter.proposer.draft_vocab)
    with pytest.raises(ValueError, match="drafts 64 tokens, not draft_vocab_size=32"):
        smaller = dataclasses.replace(warm, draft_vocab_size=32)
        train(smaller, target, slice_, [], tmp_path / "smaller", console=QUIET)
    with pytest.raises(ValueError, match="needs init 'drafter' and draft_vocab_size > 0"):
        dataclasses.replace(config, draft_vocab_from="warm_start")


def test_acceptance_is_the_cumulative_product_of_conditional_accuracy():
    correct = jnp.asarray([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], bool)
    valid = jnp.asarray([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], bool)
    stats = objective.block_stats(jnp.where(correct, 0, 3), valid)
    np.testing.assert_allclose(objective.position_accuracy(stats), [3 / 4, 3 / 4, 2 / 3])
    acc, tau = objective.acceptance(stats)
    # draft 1 right in 3 of 4; draft 2 right in 2 of the 3 that reached it; draft 3: 0 of the 1 valid one
    np.testing.assert_allclose(acc, [3 / 4, 2 / 3, 0.0])
    np.testing.assert_allclose(tau, 1 + 3 / 4 + 3 / 4 * 2 / 3)


def test_rank_acceptance_counts_ranks_among_blocks_whose_earlier_labels_are_in_the_top():
    top = objective.RANKS
    rank = jnp.asarray([[0, 2, 1], [top, 0, 0], [1, 1, top + 5], [0, 0, 7]], jnp.int32)
    valid = jnp.asarray([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], bool)
    accept = np.asarray(objective.rank_acceptance(objective.block_stats(rank, valid)))
    expected = np.zeros((3, top))
    expected[0, [0, 1]] = [2 / 4, 1 / 4]  # position 1: all four blocks count, one ranks past the top
    expected[1, [0, 1, 2]] = [1 / 3, 1 / 3, 1 / 3]  # position 2: the block whose label 1 fell out is gone
    expected[2, 1] = 1 / 2  # position 3: two blocks reach it (block 4 is invalid there); one ranks past
    np.testing.assert_allclose(accept, expected)


def test_label_rank_is_the_place_among_the_logits_with_argmax_tie_order():
    logits = jnp.asarray([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 1.0]])
    ranks = objective.label_rank(logits, jnp.asarray([2, 3], jnp.int32))
    np.testing.assert_array_equal(ranks, [1, 2])  # among equal logits the lower index ranks first
    np.testing.assert_array_equal(objective.label_rank(logits, jnp.asarray([1, -1], jnp.int32)), [0, 4])


def test_data_order_is_a_permutation_per_epoch():
    epoch0 = np.concatenate([batch_index(10, 3, 0, s) for s in range(3)])
    epoch1 = np.concatenate([batch_index(10, 3, 0, s) for s in range(3, 6)])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9 and list(epoch0) != list(epoch1)
    seqs = [(np.arange(10), 9), (np.arange(10), 3), (np.arange(90), 3)]
    padded = pad_sequences(seqs, 16)  # the first has no response token with another after it
    np.testing.assert_array_equal(padded.lengths, [10, 16])
    np.testing.assert_array_equal(padded.prompt_lens, [3, 3])


@pytest.fixture(scope="module")
def overfit(target, sequences, tmp_path_factory):
    out = tmp_path_factory.mktemp("overfit")
    return train(TINY, target, sequences[:32], sequences[32:], out, console=QUIET)


def test_overfits_own_generations_and_tau_rises(overfit, target):
    train_log = [e for e in overfit.log if "loss" in e]
    val_log = [e for e in overfit.log if "val_tau" in e]
    first, last = train_log[0], train_log[-1]
    print(f"train loss {first['loss']:.3f} -> {last['loss']:.3f}, acc {first['acc']} -> {last['acc']}")
    print(f"validation: {val_log}")
    assert overfit.step == overfit.total_steps == 300 and overfit.interrupted is None
    assert last["loss"] < 0.5 * first["loss"]
    assert val_log[-1]["val_tau"] > 1.5
    # The simulated best-first trees: nothing without nodes, more with more, c^2 above the squared mean.
    tau, square = np.asarray(val_log[-1]["val_tree_tau"]), np.asarray(val_log[-1]["val_tree_square"])
    assert len(tau) == TREE_NODES + 1 and tau[0] == 1.0 and np.all(np.diff(tau) >= 0) and tau[-1] > 1.5
    assert np.all(square >= tau**2 - 1e-3)
    assert load_drafter(overfit.drafter_dir, target).tree_commits[-1][0] == tau[-1]


def test_training_curves_plot_the_validation_records_of_metrics_jsonl(overfit):
    from dflax.plots import plot_training, read_metrics

    metrics = read_metrics(overfit.drafter_dir.parent / "metrics.jsonl")
    val = [m for m in metrics if "val_tau" in m]
    assert [m["step"] for m in val] == [150, 300]
    acc_ax, tau_ax = plot_training(metrics, positions=3)
    assert len(acc_ax.lines) == 3  # draft positions 1..3
    for k, line in enumerate(acc_ax.lines):
        assert list(line.get_xdata()) == [150, 300]
        np.testing.assert_allclose(line.get_ydata(), [m["val_accept"][k] for m in val])
    (tau_line,) = tau_ax.lines
    np.testing.assert_allclose(tau_line.get_ydata(), [m["val_tau"] for m in val])


def test_exported_drafter_decodes_losslessly(target, prompts, overfit):
    drafter = load_drafter(overfit.drafter_dir, target)
    assert drafter.config.block_size == 8
    held_out = prompts[32:40]
    plain = dflax.generate(target, held_out, max_new_tokens=32, batch_size=8)
    spec = dflax.generate(
        target,
        held_out,
        max_new_tokens=32,
        batch_size=8,
        drafter=drafter,
        block_size=drafter.trained_block_size,
    )
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    taus = [r.stats["tau"] for r in spec]
    print(f"decode tau with the trained drafter: mean {np.mean(taus):.2f}")
    assert np.mean(taus) > 1.5


def test_features_computed_each_step_equal_the_cached_ones(target, sequences, overfit, tmp_path):
    """feature_source "step": a batch's features from the device equal the cache's (padding rows and a
    batch cut to its bucket included), and the first 25 steps train as the cached run's do."""
    config = dataclasses.replace(TINY, feature_source="step")
    data = pad_sequences(sequences, TINY.max_seq_len)
    taps = config.drafter_config(target).target_layer_ids
    width = config.feature_tokens
    cached = cache_features(
        tmp_path / "features.npy", data.tokens, data.lengths, target=target, weights="w", dtype="float32",
        taps=taps, compute=feature_program(target.module, taps, width, "float32"), rows=2 * TINY.batch_size,
        pack_tokens=width, progress=Progress(console=QUIET), should_stop=lambda: False,
    )  # fmt: skip
    on_device = DeviceFeatures(steps.batch_feature_program(target.module, taps, "float32"), target.params,
                               data.tokens, data.lengths)  # fmt: skip
    for rows, bucket in (([3, -1, 0, 17], 0), ([5, 2], 16)):
        rows = np.asarray(rows)
        cut = data.width(rows, bucket)
        expected = np.asarray(cached.batch(rows, cut), np.float32)
        got = np.asarray(on_device.batch(rows, cut), np.float32)
        assert got.shape == expected.shape and not got[rows < 0].any()
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)  # one bf16 rounding apart at most
        assert np.mean(got == expected) > 0.99

    def stop_at_25(step):
        if step == 25:
            os.kill(os.getpid(), signal.SIGTERM)

    part = train(config, target, sequences[:32], sequences[32:], tmp_path / "run", console=QUIET,
                 on_step=stop_at_25)  # fmt: skip
    assert part.step == 25 and not (tmp_path / "run/features").exists()
    (first,) = [e for e in part.log if e.get("step") == 25 and "loss" in e]
    (cached_first,) = [e for e in overfit.log if e.get("step") == 25 and "loss" in e]
    np.testing.assert_allclose(first["loss"], cached_first["loss"], rtol=1e-3)
    with pytest.raises(ValueError, match="feature_source"):
        TrainConfig(feature_source="disk")


def test_resume_after_sigterm_equals_the_uninterrupted_run(target, sequences, overfit, tmp_path):
    """Stopped by SIGTERM at step 150 (between the checkpoints at 100 and 200), resumed to 300."""

    def interrupt(step):
        if step == 150:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    part = train(TINY, target, sequences[:32], sequences[32:], tmp_path, console=QUIET, on_step=interrupt)
    assert part.interrupted == signal.SIGTERM and part.step == 150 and part.drafter_dir is None
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is removed again
    resumed = train(TINY, target, sequences[:32], sequences[32:], tmp_path, console=QUIET)
    assert resumed.step == 300 and resumed.interrupted is None
    assert [e["step"] for e in resumed.log][0] > 150  # it did not start over
    jax.tree.map(np.testing.assert_array_equal, resumed.params, overfit.params)


KILLED_RUN = """
import json, os, signal, sys
import numpy as np
import dflax
from rich.console import Console
from dflax.train.trainer import TrainConfig, train

target_dir, config_path, data_path, out, kill_at = sys.argv[1:]
arrays = np.load(data_path)
seqs = [(arrays["tokens"][a:b], int(p)) for a, b, p in
        zip(arrays["offsets"][:-1], arrays["offsets"][1:], arrays["prompt_lens"])]
kill = lambda step: step == int(kill_at) and os.kill(os.getpid(), signal.SIGKILL)
config = TrainConfig(**json.loads(open(config_path).read()))
target = dflax.load_target(target_dir)
train(config, target, seqs[:32], seqs[32:], out, console=Console(quiet=True), on_step=kill)
"""


def test_resume_after_kill_9_equals_the_uninterrupted_run(
    target, tiny_checkpoint, sequences, overfit, tmp_path
):
    """Killed (SIGKILL, no handler runs) at step 150, 50 steps after its last checkpoint: the resumed run
    repeats those steps and ends in the uninterrupted run's state; its report counts each step once."""
    data = tmp_path / "sequences.npz"
    np.savez(
        data,
        tokens=np.concatenate([ids for ids, _ in sequences]),
        offsets=np.cumsum([0] + [len(ids) for ids, _ in sequences]),
        prompt_lens=np.asarray([p for _, p in sequences]),
    )
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_dict()))
    run = tmp_path / "run"
    args = [str(tiny_checkpoint("qwen3")[0]), str(tmp_path / "config.json"), str(data), str(run), "150"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *args], env=env, capture_output=True, text=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (run / METRICS).read_text().splitlines()][-1] == 150

    resumed = train(TINY, target, sequences[:32], sequences[32:], run, console=QUIET)
    assert resumed.step == 300 and [e["step"] for e in resumed.log][0] == 125  # from the checkpoint at 100
    jax.tree.map(np.testing.assert_array_equal, resumed.params, overfit.params)
    report = json.loads((run / TRAINING_RECORD).read_text())
    assert [v["step"] for v in report["validation"]] == [150, 300] and report["steps"] == 300
    assert report["validation"][-1] == {
        "step": 300,
        **{k: v for k, v in resumed.log[-1].items() if k != "step"},
    }
    assert (run / PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validation_report_has_per_position_acceptance_and_a_plot(overfit):
    run = overfit.drafter_dir.parent
    report = json.loads((run / TRAINING_RECORD).read_text())
    assert report["train"] == TINY.to_dict() and report["total_steps"] == 300
    validation = report["validation"]
    assert [v["step"] for v in validation] == [150, 300]
    for v in validation:  # per-position acceptance of B - 1 = 7 drafts and the tau it implies
        assert len(v["val_accept"]) == len(v["val_acc"]) == 7
        np.testing.assert_allclose(v["val_tau"], 1 + np.cumprod(v["val_accept"]).sum(), rtol=1e-3)  # 4 digits
    assert (run / PLOT).stat().st_size > 10_000
    exported = json.loads((overfit.drafter_dir / TRAINING_RECORD).read_text())  # travels with the weights
    assert exported == report and exported["final_validation"] == validation[-1]
    assert measured_acceptance(overfit.drafter_dir) == tuple(validation[-1]["val_accept"])


def test_warm_start_continues_from_an_exported_drafter(target, sequences, overfit, tmp_path):
    """init 'drafter' starts from the export's weights (no optimizer state): its first loss is the trained
    drafter's, far below a fresh start's; a drafter of another architecture is refused."""
    config = dataclasses.replace(
        TINY, init="drafter", init_from=str(overfit.drafter_dir), steps=2, log_every=1
    )
    warm = train(config, target, sequences[:32], sequences[32:], tmp_path / "warm", console=QUIET)
    fresh = [e for e in overfit.log if "loss" in e][0]["loss"]  # mean over the first 25 steps
    assert warm.log[0]["loss"] < 0.3 * fresh
    # Its record keeps the parent's, so a drafter trained in stages records every stage.
    lineage = json.loads((warm.drafter_dir / TRAINING_RECORD).read_text())["warm_start"]
    parent = json.loads((overfit.drafter_dir / TRAINING_RECORD).read_text())
    assert lineage == {"from": str(overfit.drafter_dir), "record": parent}
    scratch = dataclasses.replace(TINY, steps=2)  # the same directory started over from scratch
    again = train(scratch, target, sequences[:32], [], tmp_path / "warm", resume=False, console=QUIET)
    assert not (again.drafter_dir / TRAINING_RECORD).exists()  # no validation: no report, not a stale one
    exported = load_drafter(overfit.drafter_dir, target)
    module = DFlashDrafter(config.drafter_config(target), jnp.float32, "reference")
    started = warm_start_params(overfit.drafter_dir, module.config, init_drafter_params(module, 5))
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, np.asarray(b, np.float32)), started, exported.params
    )
    with pytest.raises(ValueError, match="layers(, target_layer_ids)? differ"):
        other = dataclasses.replace(config, num_layers=1)
        train(other, target, sequences[:32], sequences[32:], tmp_path / "other", console=QUIET)
    with pytest.raises(ValueError, match="needs init_from"):
        dataclasses.replace(TINY, init="drafter")
    with pytest.raises(FileNotFoundError, match="ships no drafter"):
        resolve_drafter_dir("shipped", "tiny")
    assert resolve_drafter_dir("shipped", "smollm2-135m") == shipped_drafter_path("smollm2-135m")


# The five taps of a 30-layer target the drafter's stages were trained with (the old default spread).
FIVE_TAPS_OF_30 = (1, 8, 14, 21, 27)


def test_recipe_loads_and_unknown_keys_are_named(tmp_path):
    recipe = TrainConfig.from_json(RECIPE)
    shape = (recipe.num_layers, recipe.block_size, recipe.loss_gamma, recipe.layer_kind)
    assert shape == (3, 8, 4.0, "target")
    # The shipped drafter was trained in stages with exactly the committed recipes: the first from the
    # target (RECIPE), each later one warm-started from the drafter before it (stages 2 and 3: the
    # -continue recipe; 4: -stage4, the same in bf16; 5: -stage5, with bf16 features and length
    # buckets; 6: -stage6, the same recipe over the answers stage 5 did not see; 8: -stage8, stage 5's
    # answers again with T=1 answers and the parent's draft vocabulary; 10: -stage10, the same recipe on
    # follow-up answers and part of stage 6's; 11: -stage11, the same recipe on package code answers and
    # more of stage 6's; 12 and 13: -stage12 and -stage13, the same recipe on the next package answers
    # and more of stage 6's; 14: -stage14-gpu, five epochs over every greedy answer on a GPU with the
    # features computed in the step; stages 7 and 9 were not shipped). The fields each stage records
    # match, and any field added since holds the default that reproduces it. The stages recorded
    # target_layer_ids null when the default was five taps whatever the drafter's depth; the recipes now
    # name those taps (the default follows the reference's spread for the drafter's depth).
    record = json.loads((shipped_drafter_path("smollm2-135m") / "TRAINING.json").read_text())
    stages = [record]
    while "warm_start" in stages[0]:
        stages.insert(0, stages[0]["warm_start"]["record"])
    continued = RECIPE.with_name("dflash-smollm2-continue.json")
    recipes = (RECIPE, continued, continued) + tuple(
        RECIPE.with_name(f"dflash-smollm2-stage{stage}.json")
        for stage in (4, 5, 6, 8, 10, 11, 12, 13, "14-gpu")
    )
    assert len(stages) <= len(recipes)
    for recipe_path, stage in zip(recipes, stages):
        committed = TrainConfig.from_json(recipe_path)
        recorded = dict(stage["train"])
        if recorded.get("target_layer_ids", ()) is None:
            recorded["target_layer_ids"] = list(FIVE_TAPS_OF_30)
        assert recorded == {k: v for k, v in committed.to_dict().items() if k in recorded}
        newer = set(committed.to_dict()) - set(recorded)
        assert all(getattr(committed, k) == getattr(TrainConfig(), k) for k in newer)
    for block_size, gamma in ((8, 4.0), (16, 7.0)):  # the next recipes: the paper's gamma, dense anchors
        recipe = TrainConfig.from_json(RECIPE.with_name(f"dflash-smollm2-b{block_size}.json"))
        assert (recipe.block_size, recipe.loss_gamma, recipe.init) == (block_size, gamma, "target")
        assert recipe.layer_kind == "target" and recipe.anchors_per_seq >= 256
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"block_size": 16, "lerning_rate": 1e-3}))
    with pytest.raises(ValueError, match="lerning_rate"):
        TrainConfig.from_json(bad)
    with pytest.raises(ValueError, match="distill_weight must be in \\[0, 1\\], got 1.5"):
        TrainConfig(distill_weight=1.5)
    with pytest.raises(ValueError, match="DART's loss is a KL already"):
        TrainConfig(method="dart", num_layers=1, distill_weight=0.5)


def test_pipeline_recipes_name_recipes_that_load():
    """Each committed pipeline names a data and a training recipe that load, for the same target; the
    stages train on more and more answers, stage 6 on all of them from where stage 5 stopped, and stage 8
    on stage 5's answers again."""
    from dflax.train.make_data import DataConfig
    from dflax.train.pipeline import PipelineConfig

    root = RECIPE.parents[2]
    limits = {}
    for path in sorted((root / "configs/pipeline").glob("*.json")):
        pipeline = PipelineConfig.from_json(path)
        train_config = TrainConfig.from_json(root / pipeline.train_config)
        assert DataConfig.from_json(root / pipeline.data_config).target == train_config.target
        for extra in pipeline.extra_data:  # each in a directory of its own
            assert DataConfig.from_json(root / extra.data_config).target == train_config.target
            assert extra.data_dir != pipeline.data_dir
        limits[path.stem] = (pipeline.train_limit, pipeline.train_skip)
    stages = ("dflash-smollm2", "dflash-smollm2-continue") + tuple(
        f"dflash-smollm2-stage{n}" for n in (3, 4, 5)
    )
    assert [limits[stage] for stage in stages] == sorted({limits[stage] for stage in stages})
    assert limits["dflash-smollm2-stage6"] == (None, limits["dflash-smollm2-stage5"][0])
    assert limits["dflash-smollm2-stage8"] == limits["dflash-smollm2-stage5"]


def test_pipeline_data_directories_are_committed_not_ignored():
    """Machines are not kept: every data directory a committed pipeline writes must be one git keeps
    (the classes recipe's directory was ignored by `/data/*` until its first shard was to be committed)."""
    from dflax.train.pipeline import PipelineConfig

    root = RECIPE.parents[2]
    if subprocess.run(["git", "-C", root, "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    dirs = set()
    for path in (root / "configs/pipeline").glob("*.json"):
        pipeline = PipelineConfig.from_json(path)
        dirs |= {pipeline.data_dir, *(extra.data_dir for extra in pipeline.extra_data)}
    probes = [f"{d}/{name}" for d in sorted(dirs) for name in ("manifest.json", "train-00000.npz")]
    ignored = subprocess.run(
        ["git", "-C", root, "check-ignore", "--no-index", *probes], capture_output=True, text=True
    )
    assert ignored.stdout.split() == [], f"git ignores pipeline data: {ignored.stdout.split()}"


def test_committed_manifests_name_only_committed_shards():
    """Machines are not kept: every shard a committed data manifest lists must be committed beside it (a
    manifest once listed two follow-up shards whose files were never added)."""
    root = RECIPE.parents[2]
    listed = subprocess.run(["git", "-C", root, "ls-files", "data"], capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = set(listed.stdout.split())
    manifests = sorted(f for f in tracked if f.endswith("/manifest.json"))
    assert manifests, "no committed data manifests"
    for manifest in manifests:
        splits = json.loads((root / manifest).read_text())["splits"]
        folder = manifest.rsplit("/", 1)[0]
        shards = {f"{folder}/{s['file']}" for split in splits.values() for s in split["shards"]}
        assert shards <= tracked, f"{manifest} lists uncommitted shards: {sorted(shards - tracked)}"


def test_pipeline_extra_data_and_train_skip_are_checked():
    from dflax.train.pipeline import ExtraData, PipelineConfig

    base = {"data_config": "d.json", "train_config": "t.json", "data_dir": "data", "run_dir": "run"}
    extra = {"data_config": "e.json", "data_dir": "extra"}
    assert PipelineConfig(**base, extra_data=[extra]).extra_data == (ExtraData("e.json", "extra"),)
    with pytest.raises(ValueError, match="extra_data: unknown keys \\['limit'\\]"):
        PipelineConfig(**base, extra_data=[{**extra, "limit": 3}])
    with pytest.raises(ValueError, match="train_skip must be >= 0 and below train_limit \\(8\\), got 8"):
        PipelineConfig(**base, train_limit=8, train_skip=8)
    with pytest.raises(ValueError, match="train_skip must be >= 0 and below train_limit \\(3\\), got 3"):
        PipelineConfig(**base, extra_data=[{**extra, "train_limit": 3, "train_skip": 3}])


def test_pipeline_refuses_a_data_recipe_for_another_target_before_loading_anything(tmp_path):
    from dflax.train.pipeline import PipelineConfig, run_pipeline

    (tmp_path / "t.json").write_text(json.dumps({"target": "smollm2-135m"}))
    (tmp_path / "d.json").write_text(json.dumps({"target": "smollm2-135m"}))
    (tmp_path / "e.json").write_text(json.dumps({"target": "qwen3-0.6b"}))
    pipeline = PipelineConfig(
        data_config=str(tmp_path / "d.json"),
        train_config=str(tmp_path / "t.json"),
        data_dir=str(tmp_path / "data"),
        run_dir=str(tmp_path / "run"),
        extra_data=[{"data_config": str(tmp_path / "e.json"), "data_dir": str(tmp_path / "extra")}],
    )
    with pytest.raises(ValueError, match="targets 'qwen3-0.6b' but the training recipe 'smollm2-135m'"):
        run_pipeline(pipeline)
    assert not (tmp_path / "data").exists() and not (tmp_path / "extra").exists()


def test_cli_trains_exports_and_resumes(target, tiny_checkpoint, sequences, tmp_path):
    data = write_data_dir(tmp_path / "data", {"train": sequences[:8], "validation": sequences[8:12]})
    config = dataclasses.replace(
        TINY, target=str(tiny_checkpoint("qwen3")[0]), max_seq_len=32, steps=None, epochs=1
    )
    (tmp_path / "recipe.json").write_text(json.dumps(config.to_dict()))
    args = [
        "train",
        "--config",
        str(tmp_path / "recipe.json"),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "run"),
    ]

    result = CliRunner().invoke(app, [*args, "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "8 training sequences" in result.output and "4 validation" in " ".join(result.output.split())
    assert load_drafter(tmp_path / "run/drafter", target).config.block_size == 8
    assert json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
    again = CliRunner().invoke(app, [*args, "--steps", "3"])
    assert again.exit_code == 0 and "at step 3 of 3" in " ".join(again.output.split())
    other = CliRunner().invoke(app, [*args, "--steps", "5"])
    assert other.exit_code == 2 and "--no-resume" in other.output
    warm = CliRunner().invoke(app, [*args, "--init-from", str(tmp_path / "nowhere"), "--lr", "1e-3"])
    assert warm.exit_code == 2 and "is not a drafter directory" in " ".join(warm.output.split())
    limited = [*args[:-1], str(tmp_path / "limited"), "--limit", "4", "--steps", "1"]
    first_four = CliRunner().invoke(app, limited)  # a growing data directory: its first answers only
    assert first_four.exit_code == 0 and "4 training sequences" in first_four.output


def test_feature_cache_resumes_an_interrupted_fill_and_rebuilds_for_other_data(target, tmp_path):
    width = 3 * target.config.hidden_size  # the tiny target taps its 3 layers
    rows, pack = 4, 12

    def features(tokens):  # [N, S] -> [N, S, width] bf16: a stand-in for the target's features
        return jnp.broadcast_to(jnp.asarray(tokens, jnp.bfloat16)[..., None], (*tokens.shape, width))

    def compute(params, tokens, lengths):  # the packed interface: real tokens back to back, then junk
        assert tokens.shape == (rows, 6) and lengths.sum() <= pack
        real = np.concatenate([np.asarray(features(t[None, :n]))[0] for t, n in zip(tokens, lengths)])
        return np.concatenate([real, np.full((pack - len(real), width), 9.0, jnp.bfloat16)])

    tokens = np.arange(10 * 6, dtype=np.int32).reshape(10, 6)
    lengths = np.asarray([6, 3, 5, 6, 2, 6, 4, 6, 6, 1], np.int32)
    expected = np.where((np.arange(6) < lengths[:, None])[..., None], np.asarray(features(tokens)), 0)
    calls = []
    fill = functools.partial(
        cache_features, target=target, weights="w0", dtype="float32", taps=(0, 1, 2), compute=compute,
        rows=rows, pack_tokens=pack, progress=Progress(),
    )  # fmt: skip
    stop_after_one = lambda: calls.append(1) or len(calls) > 1  # noqa: E731
    assert fill(tmp_path / "f.npy", tokens, lengths, should_stop=stop_after_one) is None
    assert json.loads((tmp_path / "f.json").read_text())["done"] == 2  # 6 + 3 tokens fit the pack of 12
    cache = fill(tmp_path / "f.npy", tokens, lengths, should_stop=lambda: False)
    assert cache.features.shape == (lengths.sum(), width)  # only real tokens are stored
    np.testing.assert_array_equal(cache.batch(np.arange(10), 6), expected)
    np.testing.assert_array_equal(cache.batch(np.asarray([2, -1]), 8)[:, :6], [expected[2], 0 * expected[2]])
    other = fill(tmp_path / "f.npy", tokens + 1, lengths, should_stop=lambda: False)
    np.testing.assert_array_equal(other.batch(np.asarray([0]), 6)[0], np.asarray(features(tokens + 1))[0])
    # Other target weights (another fingerprint) rebuild the cache too.
    calls.clear()
    assert fill(tmp_path / "f.npy", tokens + 1, lengths, should_stop=stop_after_one) is not None  # kept
    rebuilt = functools.partial(fill, weights="w1")
    assert rebuilt(tmp_path / "f.npy", tokens + 1, lengths, should_stop=stop_after_one) is None
    assert json.loads((tmp_path / "f.json").read_text())["done"] == 2


def test_feature_cache_grown_by_more_data_computes_only_the_new_sequences(target, tmp_path):
    width = 3 * target.config.hidden_size
    computed = []

    def compute(params, tokens, lengths):  # one sequence per forward; records which sequences it saw
        computed.append(int(tokens[0, 0]))
        out = np.zeros((6, width), np.float32)
        out[: lengths[0]] = tokens[0, : lengths[0], None]
        return out.astype(jnp.bfloat16)

    log = io.StringIO()  # a log file, not a terminal: the fill prints lines where a terminal gets a bar
    fill = functools.partial(
        cache_features, target=target, weights="w0", dtype="float32", taps=(0, 1, 2), compute=compute,
        rows=1, pack_tokens=6, progress=Progress(console=Console(file=log)), should_stop=lambda: False,
    )  # fmt: skip
    tokens = (np.arange(8)[:, None] * 10 + np.arange(6)).astype(np.int32)  # sequence i starts with 10 * i
    lengths = np.asarray([6, 3, 5, 6, 2, 6, 4, 6], np.int32)
    fill(tmp_path / "f.npy", tokens[:5], lengths[:5])
    assert computed == [0, 10, 20, 30, 40]
    computed.clear()
    grown = fill(tmp_path / "f.npy", tokens, lengths)  # three more shards' worth of sequences
    assert computed == [50, 60, 70] and "caching target features: 8/8 sequences" in log.getvalue()
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(grown.batch(np.asarray([i]), 6)[0, :n, 0], tokens[i, :n])
    computed.clear()
    changed = tokens.copy()
    changed[6, 1] = -1  # an edited sequence and everything after it are recomputed
    fill(tmp_path / "f.npy", changed, lengths)
    assert computed == [60, 70]
    computed.clear()
    fill(tmp_path / "f.npy", changed, lengths, weights="w1")  # other weights keep nothing
    assert computed == [0, 10, 20, 30, 40, 50, 60, 70]
    computed.clear()
    fill(tmp_path / "f.npy", changed, lengths, weights="w1", dtype="bfloat16")  # nor another precision
    assert computed == [0, 10, 20, 30, 40, 50, 60, 70]


def test_weights_fingerprint_follows_the_parameters(target, tiny_checkpoint):
    again = dflax.load_target(str(tiny_checkpoint("qwen3")[0]))
    assert weights_fingerprint(again) == weights_fingerprint(target)
    edited = jax.tree.map(lambda x: x, target.params)
    edited["params"]["norm"]["weight"] = edited["params"]["norm"]["weight"].at[0].add(1e-3)
    assert weights_fingerprint(dataclasses.replace(target, params=edited)) != weights_fingerprint(target)
    bf16 = dflax.load_target(str(tiny_checkpoint("qwen3")[0]), dtype="bfloat16")
    assert weights_fingerprint(bf16) != weights_fingerprint(target)


def test_cli_pipeline_makes_data_trains_ships_and_resumes(tiny_checkpoint, tmp_path):
    target_dir = str(tiny_checkpoint("qwen3")[0])
    data_recipe = tmp_path / "data.json"
    data_recipe.write_text(
        json.dumps({"target": target_dir, "max_prompt_tokens": 48, "max_new_tokens": 12, "shard_size": 4})
    )
    # Extra training answers from another prompt set (documented standard-library classes), in their own
    # directory, come after the main data's.
    classes_recipe = tmp_path / "classes.json"
    classes_recipe.write_text(
        json.dumps(
            {
                "target": target_dir,
                "sources": ["stdlib-classes"],
                "max_prompt_tokens": 48,
                "max_new_tokens": 12,
            }
        )
    )
    train_recipe = tmp_path / "train.json"
    config = dataclasses.replace(
        TINY, target=target_dir, max_seq_len=64, steps=4, validate_every=2, max_val_sequences=3
    )
    train_recipe.write_text(json.dumps(config.to_dict()))
    pipeline = tmp_path / "pipeline.json"
    ship = tmp_path / "shipped/tiny"
    pipeline.write_text(
        json.dumps(
            {
                "data_config": str(data_recipe),
                "train_config": str(train_recipe),
                "data_dir": str(tmp_path / "data"),
                "run_dir": str(tmp_path / "run"),
                "validation_limit": 4,
                "train_limit": 8,
                "train_skip": 2,
                "ship_to": str(ship),
                "extra_data": [
                    {
                        "data_config": str(classes_recipe),
                        "data_dir": str(tmp_path / "classes"),
                        "train_limit": 3,
                        "train_skip": 1,
                    }
                ],
            }
        )
    )
    # A later session answered more prompts than the pipeline names: it trains on its first 8 only, less
    # the first 2 (train_skip).
    more = CliRunner().invoke(
        app, ["make-data", "--config", str(data_recipe), "--out", str(tmp_path / "data"), "--limit", "12"]
    )
    assert more.exit_code == 0, more.output
    result = CliRunner().invoke(app, ["pipeline", str(pipeline)])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "data/manifest.json").read_text())["splits"]["train"]["sequences"] == 12
    record = json.loads((ship / "TRAINING.json").read_text())
    assert record["steps"] == 4 and record["train_wall_s"] > 0
    # It counts what training used: 8 - 2 + 3 - 1 answers, and 3 of the 4 held-out ones (max_val_sequences).
    assert record["data"]["train"]["sequences"] == 8 and record["data"]["validation"]["sequences"] == 3
    assert record["data"]["train_skip"] == 2
    assert record["data"]["train"]["response_tokens"] > 0
    (extra,) = record["data"]["extra"]
    assert extra["generation"]["sources"] == ["stdlib-classes"] and extra["train"]["sequences"] == 2
    assert extra["train_skip"] == 1
    classes = json.loads((tmp_path / "classes/manifest.json").read_text())["splits"]
    assert list(classes) == ["train"] and classes["train"]["sequences"] == 3
    assert record["final_validation"]["step"] == 4 and record["train"]["block_size"] == 8
    assert (ship / PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot ships beside the record
    drafter = load_drafter(ship, dflax.load_target(target_dir))
    assert drafter.config.block_size == 8

    again = CliRunner().invoke(app, ["pipeline", str(pipeline)])  # everything is done: kept and restored
    output = " ".join(again.output.split())
    assert again.exit_code == 0 and "answers are already made" in output and "at step 4 of 4" in output
