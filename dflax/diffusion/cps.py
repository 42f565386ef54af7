"""DiffuSpec's causal-consistency path search (CPS) over the token lattice (arXiv 2510.02358).

A diffusion LM fills the window's slots in parallel under bidirectional attention, so the best token of
each slot need not form a sentence read left to right. CPS walks the lattice (dflax.diffusion.lattice)
left to right with a beam of width W (3 as published); a path's score adds, per slot,

    (1 - lam) * log q(token) + lam * log(p_ngram(token | the two tokens before it on the path) + 1e-10)

with lam = 0.5 as published. p_ngram is a 3-gram prior: first the counts of the row's own text so far
(prompt and output, `history_trigram`, counted on device from the token history), and where that text
never showed the trigram, a corpus n-gram (dflax.drafters.ngram tables as DART's `NgramPrior`, trigram
with back-off to bigram) when one is given; a token no source saw scores 1e-10 (as DART does). The best
path becomes the draft chain. Slots past the lattice's end (after a certain EOS) add nothing and take
their most likely token; nothing after an EOS is ever emitted.

Static shapes, one `lax.scan` over the slots inside the decode step.

Glossary: B batch, S history slots, K window slots, M lattice columns, W beam width.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from dflax.diffusion.lattice import Lattice
from dflax.drafters.dart_tree import UNSEEN, NgramPrior, ngram_probability

CPS_BEAM_WIDTH = 3
CPS_NGRAM_WEIGHT = 0.5
_DEAD = -1e30  # the score of a beam member that does not exist yet


def history_trigram(
    sequence: jax.Array, length: jax.Array, context: jax.Array, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """How often each row's own text showed context + token, and the context followed by anything.

    Args:
      sequence: [B, S] int32 tokens by position; entries at or beyond `length` are ignored.
      length: [B] int32 valid tokens per row.
      context: [B, W, 2] int32 the two tokens before each query.
      tokens: [B, W, M] int32 the queried next tokens.

    Returns:
      trigram counts [B, W, M] and context counts [B, W] (float32).
    """
    first, second, third = sequence[:, :-2], sequence[:, 1:-1], sequence[:, 2:]  # [B, S - 2]
    inside = jnp.arange(first.shape[1]) + 2 < length[:, None]  # the trigram ends inside the text
    hit = (
        (first[:, None] == context[..., :1]) & (second[:, None] == context[..., 1:]) & inside[:, None]
    )  # [B, W, S - 2]
    follows = third[:, None, None, :] == tokens[..., None]  # [B, W, M, S - 2]
    counts = jnp.sum(hit[:, :, None] & follows, axis=-1).astype(jnp.float32)  # [B, W, M]
    return counts, jnp.sum(hit, axis=-1).astype(jnp.float32)


def ngram_prior(
    sequence: jax.Array,
    length: jax.Array,
    priors: Sequence[NgramPrior],
    context: jax.Array,
    tokens: jax.Array,
) -> jax.Array:
    """p(token | two tokens before it): the row's own trigram counts, else the corpus priors, else 0.

    Args:
      sequence, length: the row's text so far (see `history_trigram`).
      priors: corpus n-gram priors, longest order first (empty: the row's own counts only).
      context: [B, W, 2] int32.
      tokens: [B, W, M] int32.

    Returns:
      [B, W, M] float32 probabilities.
    """
    counts, totals = history_trigram(sequence, length, context, tokens)
    prob = counts / jnp.maximum(totals, 1.0)[..., None]
    if priors:
        b, w, m = tokens.shape
        flat_context = jnp.broadcast_to(context[:, :, None], (b, w, m, 2)).reshape(-1, 2)
        corpus = ngram_probability(priors, flat_context, tokens.reshape(-1)).reshape(b, w, m)
        prob = jnp.where(counts > 0, prob, corpus)
    return prob


def cps_path(
    lattice: Lattice,
    sequence: jax.Array,
    length: jax.Array,
    priors: Sequence[NgramPrior] = (),
    beam_width: int = CPS_BEAM_WIDTH,
    ngram_weight: float = CPS_NGRAM_WEIGHT,
) -> tuple[jax.Array, jax.Array]:
    """The best-scoring left-to-right path through the lattice (see the module docstring).

    Args:
      lattice: the window's lattice, K slots of M columns.
      sequence: [B, S] int32 the row's text so far by position, its newest token at length - 1 (the
        window's first slot follows it).
      length: [B] int32 valid tokens of `sequence` (>= 1).
      priors: corpus n-gram priors, longest order first, or () for the row's own counts only.
      beam_width: W.
      ngram_weight: lam, the n-gram term's weight (the drafter's is 1 - lam).

    Returns:
      tokens [B, K] int32 of the best path and its score [B] float32.
    """
    b, k, m = lattice.tokens.shape
    before = jnp.stack(
        [jnp.take_along_axis(sequence, jnp.maximum(length - i, 0)[:, None], axis=1)[:, 0] for i in (2, 1)],
        axis=-1,
    )  # [B, 2]
    before = jnp.where(jnp.arange(2) >= 2 - length[:, None], before, -1)  # a short text has no context
    score = jnp.full((b, beam_width), _DEAD, jnp.float32).at[:, 0].set(0.0)
    context = jnp.broadcast_to(before[:, None], (b, beam_width, 2))
    paths = jnp.zeros((b, beam_width, k), jnp.int32)

    def step(carry, slot):
        score, context, paths = carry
        tokens, log_q, valid, index = slot  # [B, M] x 3, []
        inside = index < lattice.length  # [B]
        cand = jnp.broadcast_to(tokens[:, None], (b, beam_width, m))  # [B, W, M]
        p = ngram_prior(sequence, length, priors, context, cand)
        term = (1 - ngram_weight) * log_q[:, None] + ngram_weight * jnp.log(p + UNSEEN)  # [B, W, M]
        term = jnp.where(inside[:, None, None], term, 0.0)
        member = valid & (inside[:, None] | (jnp.arange(m) == 0))  # past the end: the top token only
        child = jnp.where(member[:, None], score[..., None] + term, -jnp.inf).reshape(b, -1)  # [B, W * M]
        score, chosen = jax.lax.top_k(child, beam_width)  # [B, W], ties: the lower index first
        parent, column = chosen // m, chosen % m
        token = jnp.take_along_axis(tokens, column, axis=1)  # [B, W]
        paths = jnp.take_along_axis(paths, parent[..., None], axis=1).at[:, :, index].set(token)
        context = jnp.stack([jnp.take_along_axis(context[..., 1], parent, axis=1), token], axis=-1)
        return (score, context, paths), None

    slots = (
        jnp.moveaxis(lattice.tokens, 1, 0),
        jnp.moveaxis(lattice.log_q, 1, 0),
        jnp.moveaxis(lattice.valid, 1, 0),
        jnp.arange(k),
    )
    (score, _, paths), _ = jax.lax.scan(step, (score, context, paths), slots)
    return paths[:, 0], score[:, 0]
