"""The DFlash training objective (arXiv 2602.06036): many anchors, one masked block per anchor, weighted CE.

For a sequence of S tokens with target features F [S, K * D], the drafter's per-layer context K/V is
computed once (`DFlashDrafter.context_kv`). Each of M anchors a_m inside the response (random distinct
positions, or every `stride`-th one) starts one block [token a_m, MASK x n] at positions [a_m, a_m + B).
All M blocks of a sequence run in ONE drafter forward (`DFlashDrafter.anchored_blocks`): block m sees the
context strictly before its anchor plus its own block (bidirectionally) and never another block, the
block-sparse mask of the paper laid out as per-block context lengths over the shared context K/V (no
copy per block; cost linear in M, see `dflax.models.block_attention`). Its layers and math are those of
the decoding forward (`DFlashProposer.draft_hidden`, one block per row with the context cache cut at the
anchor), which the tests hold it equal to. The target's frozen LM head reads the blocks: block position k
predicts token a_m + k (no shift). The loss is the cross-entropy at the n = B - 1 mask positions weighted
exp(-(k - 1) / gamma), masked where a_m + k is past the sequence end.

Glossary: N sequences, S padded sequence length, M anchors per sequence, R = N * M block rows,
n = B - 1 drafted positions, D width, V vocabulary. All shapes are static; variation is masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from dflax.drafters.dflash import DFlashDrafter, DFlashProposer
from dflax.drafters.draft_vocab import vocab_index
from dflax.models.cache import KVCache
from dflax.models.packing import Packing
from dflax.models.transformer import Transformer
from dflax.train.tree_acceptance import TREE_NODES, tree_accepted_drafts

# The paper's decay of the position weights per block size.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """gamma of the paper for B = 16 / 10 / 8 (7 / 5 / 4)."""
    if block_size not in PAPER_GAMMA:
        raise ValueError(
            f"no published loss decay gamma for block size {block_size} (known: {sorted(PAPER_GAMMA)}); "
            "set `gamma` in the training config"
        )
    return PAPER_GAMMA[block_size]


def position_weights(block_size: int, gamma: float) -> jax.Array:
    """[n] loss weight exp(-(k - 1) / gamma) of block position k = 1..n."""
    k = jnp.arange(1, block_size, dtype=jnp.float32)
    return jnp.exp(-(k - 1.0) / gamma)


@struct.dataclass
class Blocks:
    """The training blocks of a batch, one row per anchor (row r belongs to sequence r // M).

    Attributes:
      anchors: [R] int32 anchor positions a_m (0 for unused rows).
      tokens: [R] int32 the anchor tokens.
      labels: [R, n] int32 tokens a_m + 1 .. a_m + n (0 where invalid).
      valid: [R, n] bool, the anchor is used and a_m + k lies inside its sequence.
    """

    anchors: jax.Array
    tokens: jax.Array
    labels: jax.Array
    valid: jax.Array


def sample_anchors(
    key: jax.Array, prompt_len: jax.Array, length: jax.Array, max_len: int, num_anchors: int, stride: int = 0
):
    """Distinct anchors inside one sequence's response, deterministic under `key`.

    An anchor a is a committed response token with at least one token after it:
    prompt_len <= a <= length - 2 (the first response token is the target's own, as at decode time).

    Args:
      key: PRNG key.
      prompt_len: [] int32 prompt tokens.
      length: [] int32 tokens in the sequence (prompt + response).
      max_len: S, the padded length (static).
      num_anchors: M (static).
      stride: 0 = M random distinct candidates; s >= 1 = every s-th candidate from a random offset in
        [0, s) (s = 1: every response position), the first M of them.

    Returns:
      (anchors [M] int32, used [M] bool); fewer than M candidates leave the remaining rows unused.
    """
    if stride:
        offset = jax.random.randint(key, (), 0, stride)
        anchors = prompt_len + offset + stride * jnp.arange(num_anchors, dtype=jnp.int32)  # [M]
        used = anchors <= length - 2
        return jnp.where(used, anchors, 0).astype(jnp.int32), used
    positions = jnp.arange(max_len, dtype=jnp.int32)  # [S]
    candidate = (positions >= prompt_len) & (positions <= length - 2)
    scores = jnp.where(candidate, jax.random.uniform(key, (max_len,)), -1.0)  # [S]
    top, anchors = jax.lax.top_k(scores, num_anchors)  # [M], [M]
    used = top >= 0.0
    return jnp.where(used, anchors, 0).astype(jnp.int32), used


def make_blocks(
    key: jax.Array,
    tokens: jax.Array,
    prompt_lens: jax.Array,
    lengths: jax.Array,
    num_anchors: int,
    n: int,
    stride: int = 0,
) -> Blocks:
    """Samples M anchors per sequence and gathers their anchor tokens and labels.

    Args:
      key: PRNG key (each sequence folds in its index).
      tokens: [N, S] int32 padded sequences.
      prompt_lens: [N] int32.
      lengths: [N] int32 real lengths (padding rows have length 0 and get no anchors).
      num_anchors: M.
      n: drafted positions per block (B - 1).
      stride: anchor placement (see `sample_anchors`).

    Returns:
      Blocks with R = N * M rows, sequence-major.
    """
    num_seqs, max_len = tokens.shape
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_seqs))
    anchors, used = jax.vmap(lambda k, p, s: sample_anchors(k, p, s, max_len, num_anchors, stride))(
        keys, prompt_lens, lengths
    )  # [N, M], [N, M]
    offsets = anchors[:, :, None] + jnp.arange(1, n + 1, dtype=jnp.int32)  # [N, M, n]
    valid = used[:, :, None] & (offsets < lengths[:, None, None])  # [N, M, n]
    gather = jax.vmap(lambda seq, idx: jnp.take(seq, idx, mode="clip"))
    labels = jnp.where(valid, gather(tokens, offsets), 0)  # [N, M, n]
    return Blocks(
        anchors=anchors.reshape(-1),
        tokens=gather(tokens, anchors).reshape(-1),
        labels=labels.reshape(num_seqs * num_anchors, n),
        valid=valid.reshape(num_seqs * num_anchors, n),
    )


def target_features(
    target: Transformer,
    target_params,
    tokens: jax.Array,
    lengths: jax.Array,
    tap_layers: tuple[int, ...],
    pack_tokens: int,
) -> jax.Array:
    """The drafter's context features of whole sequences, through the target's prefill path.

    The forward is the one a prompt takes at decode time: an empty cache and the real tokens packed back to
    back (`dflax.models.packing`), so padding costs no token-wise work.

    Args:
      target: the target module.
      target_params: its (frozen) parameters.
      tokens: [N, S] int32 right-padded sequences.
      lengths: [N] int32 real tokens per row (0 = an unused row); sum(lengths) <= pack_tokens.
      tap_layers: the drafter's target_layer_ids.
      pack_tokens: L, the static size of the pack.

    Returns:
      [L, K * D] features of the real tokens in the target's dtype: row 0's, then row 1's, ...; the rows
      past sum(lengths) hold nothing meaningful.
    """
    packing = Packing.of_lengths(lengths, tokens.shape[1], pack_tokens)
    return _packed_features(target, target_params, tokens, packing, tap_layers)


def _packed_features(
    target: Transformer, target_params, tokens: jax.Array, packing: Packing, tap_layers: tuple[int, ...]
) -> jax.Array:
    """`target_features` of [N, S] `tokens` laid out by `packing`: [L, K * D]."""
    num_seqs, max_len = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (num_seqs, max_len))
    cache = KVCache.init(target.config, num_seqs, max_len, target.dtype)
    _, _, taps = target.apply(
        target_params, tokens, positions, cache, None, tap_layers, empty_cache=True, packing=packing
    )  # new_mask None: causal by index; taps: [1, L, D] each
    return jax.lax.stop_gradient(jnp.concatenate(taps, axis=-1)[0])


def padded_target_features(
    target: Transformer,
    target_params,
    tokens: jax.Array,
    lengths: jax.Array,
    tap_layers: tuple[int, ...],
) -> jax.Array:
    """`target_features` of a batch laid back out as the batch: [N, S, K * D], zero past each length.

    Args:
      tokens: [N, S] int32 right-padded sequences.
      lengths: [N] int32 real tokens per row (0 = an empty row).
    """
    num_seqs, max_len = tokens.shape
    packing = Packing.of_lengths(lengths, max_len, num_seqs * max_len)
    packed = _packed_features(target, target_params, tokens, packing, tap_layers)  # [N * S, K * D]
    return packing.unpack(packed)  # [N, S, K * D]


def block_hidden(
    proposer: DFlashProposer, params, target_params, features: jax.Array, blocks: Blocks, chunk: int
) -> jax.Array:
    """The drafter's hidden states of every block: one forward per sequence over all its blocks.

    Args:
      proposer: the DFlash proposer (its block size is B).
      params: drafter parameters (trained).
      target_params: target parameters (embedding rows; frozen).
      features: [N, S, K * D] target features of the sequences.
      blocks: R = N * M rows, sequence-major.
      chunk: blocks per attention chunk (see `dflax.models.block_attention`).

    Returns:
      [R, B, D] hidden states; position k predicts blocks.labels[:, k - 1].
    """
    num_seqs, max_len, _ = features.shape
    rows, width = blocks.anchors.shape[0], proposer.num_draft + 1
    per_seq = rows // num_seqs
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (num_seqs, max_len))
    ks, vs = proposer.module.apply(params, features, positions, method=DFlashDrafter.context_kv)
    inputs = proposer.block_inputs(params, target_params, blocks.tokens)  # [R, B, D]
    block_positions = blocks.anchors[:, None] + jnp.arange(width, dtype=jnp.int32)  # [R, B]
    hidden = proposer.module.apply(
        params,
        inputs.reshape(num_seqs, per_seq, width, -1),
        block_positions.reshape(num_seqs, per_seq, width),
        ks,
        vs,
        blocks.anchors.reshape(num_seqs, per_seq),
        chunk,
        method=DFlashDrafter.anchored_blocks,
    )  # [N, M, B, D]
    return hidden.reshape(rows, width, -1)


def target_next_token_log_probs(target: Transformer, target_params, final_hidden, vocab_ids) -> jax.Array:
    """The target's next-token log-probabilities from its last layer's output [..., D] (before the final
    norm), over the draft vocabulary `vocab_ids` [V'] (renormalised) or all of it (None): [..., V']."""
    logits = target.apply(
        target_params, final_hidden, vocab_ids, method=lambda m, h, ids: m.logits(m.norm(h), ids)
    )
    return jax.nn.log_softmax(logits, axis=-1)


def token_scores(
    readout: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    labels: jax.Array,
    chunk_rows: int,
    target_readout: Callable[[jax.Array], jax.Array] | None = None,
    target_hidden: jax.Array | None = None,
    candidates: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """Cross-entropy and rank of the drafted positions' labels (and, given the target's hidden states, the
    KL from the target's next-token distribution and the overlap with it; with `candidates`, the drafter's
    best log-probabilities), `chunk_rows` rows of logits at a time.

    Each chunk's [chunk_rows, n, V'] logits are recomputed in the backward pass instead of stored, so the
    LM head's memory is one chunk's, not R rows'.

    Args:
      readout: the drafter's LM head, [C, n, D] -> [C, n, V'] logits (`DFlashProposer.draft_logits`).
      hidden: [R, B, D] drafter hidden states.
      labels: [R, n] int32 indices into the read-out's V' tokens; -1 = a token it cannot draft.
      chunk_rows: rows per LM-head chunk.
      target_readout: [C, n, D] -> [C, n, V'] the target's log-probabilities over the same V' tokens
        (`target_next_token_log_probs`), or None: no KL.
      target_hidden: [R, n, D] the target's last-layer output at the position before each label.
      candidates: also return the RANKS best log-probabilities of each position (a tree's candidates).

    Returns:
      (ce [R, n] float32, meaningless where labels is -1; rank [R, n] int32: the label's place among the
      drafter's candidates, 0 = its argmax (see `label_rank`); kl [R, n] float32 KL(p || q) of the
      target's p and the drafter's q over the V' tokens; overlap [R, n] sum min(p, q), the chance that
      token-by-token speculative sampling keeps a draft sampled from q at temperature 1; kl and overlap
      None without `target_readout`; top [R, n, RANKS] float32 log-probabilities, descending, or None
      without `candidates`).
    """
    rows, n = labels.shape
    chunks = -(-rows // chunk_rows)
    pad = chunks * chunk_rows - rows

    def chunked(x):  # [R, ...] -> [chunks, C, ...]
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
        return x.reshape(chunks, chunk_rows, *x.shape[1:])

    h, y = chunked(hidden[:, 1:]), chunked(labels)
    t = None if target_readout is None else chunked(target_hidden)

    @jax.checkpoint
    def score(args):
        h_c, y_c, t_c = args  # [C, n, D], [C, n], [C, n, D] or None
        logits = readout(h_c)  # [C, n, V'] float32
        log_norm = jax.nn.logsumexp(logits, axis=-1)  # [C, n]
        picked = jnp.take_along_axis(logits, jnp.maximum(y_c, 0)[..., None], axis=-1)[..., 0]  # [C, n]
        kl = overlap = top = None
        if candidates:
            top = jax.lax.top_k(logits, RANKS)[0] - log_norm[..., None]  # [C, n, RANKS]
        if t_c is not None:
            log_p = target_readout(t_c)  # [C, n, V']
            log_q = logits - log_norm[..., None]
            kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [C, n]
            overlap = jnp.sum(jnp.exp(jnp.minimum(log_p, log_q)), axis=-1)  # [C, n]
        return log_norm - picked, label_rank(logits, y_c), kl, overlap, top

    scores = jax.lax.map(score, (h, y, t))  # [chunks, C, n, ...] each (or None)
    return tuple(None if x is None else x.reshape(-1, *x.shape[2:])[:rows] for x in scores)


def label_rank(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """[...] int32 place of each label among its logits [..., V]: 0 when it is the argmax (the first of
    equal maxima, as `argmax` picks), r when the drafter ranks r candidates before it; a label of -1
    (a token the drafter cannot draft) gets V."""
    picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)  # [..., 1]
    index = jnp.arange(logits.shape[-1])
    before = (logits > picked) | ((logits == picked) & (index < jnp.maximum(labels, 0)[..., None]))
    rank = jnp.sum(before, axis=-1, dtype=jnp.int32)
    return jnp.where(labels >= 0, rank, logits.shape[-1])


# Candidate places per drafted position that the stats count (enough for best-first trees of ~64 nodes).
RANKS = 8


@struct.dataclass
class BlockStats:
    """Summable counts of a batch's blocks, per drafted position k = 1..n (each [n] float32).

    Attributes:
      correct: blocks whose draft k is right (among those where k is valid).
      valid: blocks where k lies inside the sequence.
      accepted: blocks whose drafts 1..k are all right (k valid): greedy verification accepts k drafts.
      reached: blocks whose drafts 1..k-1 are all right (k valid): verification reaches draft k.
      ranked: blocks whose labels 1..k-1 all rank below RANKS (k valid): a tree holding the top RANKS
        candidates of every position reaches position k.
      rank_count: [n, RANKS] of the `ranked` blocks, those whose label k has rank r.
      overlap: the sum over valid blocks of sum_x min(p_k(x), q_k(x)), the target's and the drafter's
        distributions at k (0 where the loss did not read the target's: see `dflash_loss`).
      whole: [] blocks valid at every position, the ones whose best-first trees were simulated (0 where
        the loss did not simulate them: `dflash_loss`'s `tree_stats`).
      tree_committed: [TREE_NODES + 1] of the `whole` blocks, the sum of the tokens c = 1 + the accepted
        drafts that a tree of N nodes commits, N = 0 .. TREE_NODES (`tree_acceptance`).
      tree_committed_square: [TREE_NODES + 1] the sum of c^2.
    """

    correct: jax.Array
    valid: jax.Array
    accepted: jax.Array
    reached: jax.Array
    ranked: jax.Array
    rank_count: jax.Array
    overlap: jax.Array
    whole: jax.Array
    tree_committed: jax.Array
    tree_committed_square: jax.Array

    def __add__(self, other: BlockStats) -> BlockStats:
        return jax.tree.map(jnp.add, self, other)


def block_stats(
    rank: jax.Array,
    valid: jax.Array,
    overlap: jax.Array | None = None,
    top_log_probs: jax.Array | None = None,
) -> BlockStats:
    """Counts from the labels' ranks [R, n] int32 (0 = the drafter's argmax, see `label_rank`), the
    blocks' validity [R, n] bool, when the loss read the target's distributions their overlap with the
    drafter's [R, n] float32, and given the drafter's best log-probabilities [R, n, RANKS] per position,
    the best-first trees' commits (`tree_acceptance`)."""
    correct = rank == 0
    prefix = jnp.cumprod(correct, axis=1).astype(jnp.bool_)  # [R, n] drafts 1..k all right
    before = jnp.concatenate([jnp.ones_like(prefix[:, :1]), prefix[:, :-1]], axis=1)  # drafts 1..k-1
    in_top = jnp.cumprod(rank < RANKS, axis=1).astype(jnp.bool_)  # [R, n] labels 1..k all in the top
    ranked = jnp.concatenate([jnp.ones_like(in_top[:, :1]), in_top[:, :-1]], axis=1) & valid  # [R, n]
    one_hot = rank[..., None] == jnp.arange(RANKS)  # [R, n, RANKS]
    count = lambda x: jnp.sum(x & valid, axis=0, dtype=jnp.float32)
    return BlockStats(
        count(correct),
        count(valid),
        count(prefix),
        count(before),
        count(ranked),
        jnp.sum(one_hot & ranked[..., None], axis=0, dtype=jnp.float32),
        jnp.zeros(rank.shape[1:]) if overlap is None else jnp.sum(jnp.where(valid, overlap, 0.0), axis=0),
        *_tree_counts(rank, valid, top_log_probs),
    )


def _tree_counts(
    rank: jax.Array, valid: jax.Array, top_log_probs: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(whole blocks, their sum of c and of c^2 per tree budget) for `BlockStats`; zeros without
    candidates."""
    if top_log_probs is None:
        zeros = jnp.zeros((TREE_NODES + 1,), jnp.float32)
        return jnp.zeros((), jnp.float32), zeros, zeros
    whole = jnp.all(valid, axis=1)  # [R]: a block cut by the sequence's end would count as rejected
    committed = 1.0 + tree_accepted_drafts(top_log_probs, rank).astype(jnp.float32)  # [R, TREE_NODES + 1]
    committed = jnp.where(whole[:, None], committed, 0.0)
    return jnp.sum(whole, dtype=jnp.float32), committed.sum(axis=0), jnp.sum(committed**2, axis=0)


def position_accuracy(stats: BlockStats) -> jax.Array:
    """[n] fraction of valid blocks whose draft k is right (each position on its own)."""
    return stats.correct / jnp.maximum(stats.valid, 1.0)


def acceptance(stats: BlockStats) -> tuple[jax.Array, jax.Array]:
    """Greedy-verification acceptance per position and the estimated tau.

    acc_k = P(draft k right | drafts 1..k-1 right) and tau = 1 + sum_k prod_{j <= k} acc_j: the mean
    tokens committed per verify step (the bonus token included) if every block were drafted like these.

    Returns:
      (acc [n], tau []).
    """
    acc = stats.accepted / jnp.maximum(stats.reached, 1.0)  # [n]
    return acc, 1.0 + jnp.sum(jnp.cumprod(acc))


def sampled_acceptance(stats: BlockStats) -> tuple[jax.Array, jax.Array]:
    """Token-by-token speculative sampling's acceptance at temperature 1 (target and drafts) per position,
    and its tau (block verification, which decodes, keeps at least as many drafts).

    acc_k = the mean over valid blocks of sum_x min(p_k(x), q_k(x)), p_k the target's next-token
    distribution after the sequence's own tokens and q_k the drafter's (0 when the loss did not read the
    target's distributions); positions taken as independent, tau = 1 + sum_k prod_{j <= k} acc_j.

    Returns:
      (acc [n], tau []).
    """
    acc = stats.overlap / jnp.maximum(stats.valid, 1.0)  # [n]
    return acc, 1.0 + jnp.sum(jnp.cumprod(acc))


def tree_commit_curve(stats: BlockStats) -> jax.Array:
    """[TREE_NODES + 1, 2] E[c] and E[c^2] of the tokens one step commits with a best-first tree of N
    nodes, N = 0 .. TREE_NODES, over the simulated blocks (`tree_acceptance`); the form of
    `dflax.planning.tree_budget.tree_commit_moments`."""
    whole = jnp.maximum(stats.whole, 1.0)
    return jnp.stack([stats.tree_committed / whole, stats.tree_committed_square / whole], axis=1)


def rank_acceptance(stats: BlockStats) -> jax.Array:
    """[n, RANKS] P(label k has rank r | labels 1..k-1 rank below RANKS): what a tree over the top
    candidates of each position accepts at depth k (see dflax.planning.tree_budget)."""
    return stats.rank_count / jnp.maximum(stats.ranked, 1.0)[:, None]


def dflash_loss(
    proposer: DFlashProposer,
    params,
    target_params,
    features: jax.Array,
    blocks: Blocks,
    weights: jax.Array,
    chunk_rows: int,
    attention_chunk: int,
    final_hidden: jax.Array | None = None,
    distill_weight: float = 0.0,
    tree_stats: bool = False,
) -> tuple[jax.Array, BlockStats]:
    """The weighted block loss of a batch: cross-entropy to the target's tokens, mixed with the KL from
    the target's next-token distribution when `distill_weight` > 0.

    Args:
      proposer: the DFlash proposer (drafter and target modules, block size B).
      params: drafter parameters (differentiated).
      target_params: target parameters (frozen: gradients stop here).
      features: [N, S, K * D] target features.
      blocks: the batch's blocks (R = N * M rows).
      weights: [n] position weights.
      chunk_rows: LM-head rows per chunk.
      attention_chunk: blocks per attention chunk.
      final_hidden: [N, S, D] the target's last-layer output (before its final norm) at every position;
        needed when distill_weight > 0. Given, the stats also carry each position's overlap with the
        target's distribution (acceptance at temperature 1, `sampled_acceptance`).
      distill_weight: lambda in [0, 1]: each position's loss is (1 - lambda) * ce + lambda * KL(p || q),
        p the target's next-token distribution (temperature 1) before the label and q the drafter's, both
        over the draft vocabulary. Acceptance at temperature 1 is the overlap sum min(p, q), which the
        cross-entropy to the greedy tokens alone does not train.
      tree_stats: simulate each block's best-first draft trees (`tree_acceptance`) into the stats: for
        validation, not training steps.

    Returns:
      (loss: sum_k w_k * loss_k * valid / sum_k w_k * valid, the batch's BlockStats). With a draft
      vocabulary, labels outside it carry no loss and count as wrong drafts in the stats.
    """
    target_params = jax.lax.stop_gradient(target_params)
    hidden = block_hidden(proposer, params, target_params, features, blocks, attention_chunk)  # [R, B, D]
    labels = blocks.labels  # [R, n] target token ids
    vocab_ids = None
    if proposer.draft_vocab is not None:
        vocab_ids = jnp.asarray(proposer.draft_vocab)
        index = vocab_index(proposer.draft_vocab, proposer.target.config.vocab_size)  # [V]
        labels = jnp.take(jnp.asarray(index), labels)  # [R, n] draft-vocabulary indices, -1 outside
    readout = functools.partial(proposer.draft_logits, target_params)
    target_readout = target_hidden = None
    if distill_weight and final_hidden is None:
        raise ValueError("dflash_loss: distill_weight > 0 needs the target's final_hidden")
    if final_hidden is not None:
        n = labels.shape[1]
        per_seq = blocks.anchors.shape[0] // final_hidden.shape[0]
        before = blocks.anchors[:, None] + jnp.arange(n, dtype=jnp.int32)  # [R, n]: label k's position - 1
        rows = jnp.repeat(jnp.arange(final_hidden.shape[0]), per_seq)  # [R] each block's sequence
        target_hidden = final_hidden[rows[:, None], jnp.minimum(before, final_hidden.shape[1] - 1)]
        target_readout = functools.partial(
            target_next_token_log_probs, proposer.target, target_params, vocab_ids=vocab_ids
        )
    ce, rank, kl, overlap, top = token_scores(
        readout, hidden, labels, chunk_rows, target_readout, target_hidden, candidates=tree_stats
    )
    position_loss = (1.0 - distill_weight) * ce + distill_weight * kl if distill_weight else ce
    w = weights[None, :] * (blocks.valid & (labels >= 0))  # [R, n]
    loss = jnp.sum(w * position_loss) / jnp.maximum(jnp.sum(w), 1e-9)
    return loss, block_stats(rank, blocks.valid, overlap, top)
