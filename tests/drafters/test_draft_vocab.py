"""A pruned draft vocabulary: which tokens it keeps, the LM-head read-out of a subset, lossless decoding with
drafts taken only from the subset, and the round trip through a drafter checkpoint."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dflax
from dflax.checkpoints.params import CheckpointError
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import load_drafter
from dflax.drafters.checkpoint import save_drafter
from dflax.drafters.draft_vocab import check_draft_vocab, frequent_tokens, vocab_index
from dflax.models.transformer import Transformer
from dflax.runtime.static_batches import generate_ids

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def greedy(target, drafter=None):
    results = generate_ids(
        target,
        PROMPTS,
        max_new_tokens=16,
        sampling=SamplingParams.make(),
        row_seeds=list(range(len(PROMPTS))),
        batch_size=4,
        drafter=drafter,
    )
    return [r.tokens for r in results], [r.stats["accept_hist"] for r in results]


def with_vocab(drafter, ids):
    vocab = check_draft_vocab(np.asarray(ids), drafter.config.layers.vocab_size)
    return dataclasses.replace(drafter, proposer=dataclasses.replace(drafter.proposer, draft_vocab=vocab))


def test_frequent_tokens_count_responses_only():
    sequences = [(np.array([9, 9, 9, 4, 4, 7]), 3), (np.array([9, 7, 2, 2]), 1)]
    # responses: [4, 4, 7] and [7, 2, 2]: counts 2 -> 2, 4 -> 2, 7 -> 2; prompt token 9 does not count
    assert frequent_tokens(sequences, 3, 10).tolist() == [2, 4, 7]
    assert frequent_tokens(sequences, 5, 10).tolist() == [2, 4, 7, 0, 1]  # then unseen tokens by id
    with pytest.raises(ValueError, match=r"must be in \[1, 10\]"):
        frequent_tokens(sequences, 11, 10)


def test_draft_vocab_checks_and_index():
    with pytest.raises(ValueError, match="distinct"):
        check_draft_vocab(np.array([1, 1]), 10)
    with pytest.raises(ValueError, match=r"lie in \[0, 10\)"):
        check_draft_vocab(np.array([3, 10]), 10)
    assert vocab_index(np.array([5, 2]), 6).tolist() == [-1, -1, 1, -1, -1, 0]


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # separate LM head, tied embedding
def test_subset_read_out_equals_the_full_logits_there(tiny_checkpoint, name):
    model = dflax.load_target(str(tiny_checkpoint(name)[0]))
    hidden = jax.random.normal(jax.random.key(0), (2, 3, model.config.hidden_size))
    ids = jnp.asarray([17, 3, 200, 255])
    full = model.module.apply(model.params, hidden, method=Transformer.logits)  # [2, 3, V]
    subset = model.module.apply(model.params, hidden, ids, method=Transformer.logits)  # [2, 3, 4]
    np.testing.assert_allclose(np.asarray(subset), np.asarray(full)[..., ids], rtol=1e-6, atol=1e-6)


def test_pruned_drafter_is_lossless(target):
    expected, _ = greedy(target)
    drafter = with_vocab(load_drafter("untrained", target, block_size=4), np.arange(0, 256, 2))
    got, _ = greedy(target, drafter)
    assert got == expected


def test_drafts_come_only_from_the_draft_vocabulary(target):
    expected, _ = greedy(target)
    generated = {t for row in expected for t in row}
    outside = np.setdiff1d(np.arange(target.config.vocab_size), sorted(generated))
    drafter = with_vocab(load_drafter("untrained", target, block_size=4), outside)
    got, hists = greedy(target, drafter)
    assert got == expected
    # Every draft lies outside what the target generates, so no step commits more than one token.
    assert all(sum(hist[2:]) == 0 for hist in hists), hists


def test_draft_vocab_round_trips_through_the_checkpoint(tmp_path, target):
    drafter = with_vocab(load_drafter("untrained", target, block_size=4), [9, 4, 100])
    drafter.save(tmp_path)
    assert load_file(str(tmp_path / "model.safetensors"))["draft_vocab"].tolist() == [9, 4, 100]
    loaded = load_drafter(tmp_path, target)
    assert loaded.proposer.draft_vocab.tolist() == [9, 4, 100]

    bad = tmp_path / "bad"
    save_drafter(bad, drafter.config, drafter.params, target.config.num_layers, draft_vocab=np.array([1, 2]))
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["draft_vocab"] = np.array([1, 1], np.int32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="distinct"):
        load_drafter(bad, target)
