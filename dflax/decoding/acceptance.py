"""Acceptance rules for a chain of draft tokens: which drafts the target keeps, and the token after them.

Every drafter verifies through this module, so "lossless" is decided in one place (see
design/verification.md). The target's distribution always comes from `sampling.target_log_probs`.

- `accept_delta`: drafts chosen deterministically (argmax of parallel marginals, top-k, beam). The draft
  is a one-hot proposal: sample y_i from the target at every position, accept while draft == y, then emit
  y at the first mismatch. Exact at every temperature (DFlash's verification rule on a chain).
- `accept_block`: drafts sampled from the drafter's q, verified as one block (block verification; Sun et
  al., ICLR 2025). It decides how many drafts to keep from the whole block's likelihood ratios, so a draft
  that token-by-token speculative sampling (Leviathan et al. 2023, Chen et al. 2023) would reject can be
  kept when the drafts after it make up for it. Exact only when each draft really was drawn from the q
  passed in; never fewer tokens per step in expectation than the token-by-token rule.

All rules take the target's logits for the verified block, where position i scores the token that should
follow the committed prefix and the first i drafts: logits[:, i] scores draft i, logits[:, T] scores the
bonus token after all T drafts. The tree rule (`dflax.decoding.tree.accept_tree`) returns the same
`Acceptance` plus the accepted path.

Glossary: B batch, T draft length, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dflax.decoding.sampling import (
    NEG_INF,
    SamplingParams,
    categorical,
    sample,
    split_keys,
    target_log_probs,
    uniform,
)


@struct.dataclass
class Acceptance:
    """The outcome of verifying one block of drafts.

    Attributes:
      num_accepted: [B] int32, how many drafts were accepted (0..T).
      tokens: [B, T + 1] int32, the committed tokens: the accepted drafts, then the target's own token
        (correction or bonus) at index num_accepted; entries after it are 0. Each row commits
        num_accepted + 1 tokens.
    """

    num_accepted: jax.Array
    tokens: jax.Array


def commit_tokens(draft_tokens: jax.Array, num_accepted: jax.Array, next_tokens: jax.Array) -> Acceptance:
    """Accepted drafts, then next_tokens[:, num_accepted], then zeros (shared by the chain and tree rules).

    Args:
      draft_tokens: [B, T] drafts.
      num_accepted: [B] accepted prefix length.
      next_tokens: [B, T + 1] the target's token at each position, read only at num_accepted.
    """
    padded = jnp.pad(draft_tokens.astype(jnp.int32), ((0, 0), (0, 1)))  # [B, T + 1]
    position = jnp.arange(padded.shape[1])  # [T + 1]
    n = num_accepted[:, None]  # [B, 1]
    tokens = jnp.where(position < n, padded, jnp.where(position == n, next_tokens.astype(jnp.int32), 0))
    return Acceptance(num_accepted=num_accepted.astype(jnp.int32), tokens=tokens)


def _accepted_prefix_length(accept: jax.Array) -> jax.Array:
    """[B, T] bool per-position acceptance -> [B] int32 length of the all-accepted prefix."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def _accept_matching(draft_tokens: jax.Array, target_tokens: jax.Array) -> Acceptance:
    """Accepts drafts while they equal the target's tokens, then commits the target's token.

    Args:
      draft_tokens: [B, T] drafts.
      target_tokens: [B, T + 1] the target's token at every position of the block.
    """
    num_accepted = _accepted_prefix_length(draft_tokens == target_tokens[:, :-1])
    return commit_tokens(draft_tokens, num_accepted, target_tokens)


def accept_delta(
    key: jax.Array, draft_tokens: jax.Array, target_logits: jax.Array, params: SamplingParams
) -> Acceptance:
    """The delta rule for deterministically chosen drafts, exact at any temperature, top-k and top-p.

    Samples y_i from the target distribution at every position, accepts while draft_i == y_i and emits y
    at the first mismatch (or y_T as the bonus). At temperature 0 it is greedy verification: drafts are
    accepted while they equal the target's argmax.

    Args:
      key: one PRNG key, or [B] row keys.
      draft_tokens: [B, T] int drafts, chosen without sampling from a proposal distribution.
      target_logits: [B, T + 1, V] target logits for the block.
      params: the target's sampling settings.

    Returns:
      The accepted drafts followed by the target's sample at the first mismatch.
    """
    return _accept_matching(draft_tokens, sample(key, target_logits, params))


def accept_block(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_log_probs: jax.Array,
    target_logits: jax.Array,
    params: SamplingParams,
) -> Acceptance:
    """Block verification of drafts sampled from the drafter's distribution q.

    With p_i and q_i the target's and the drafter's distributions at position i (q_T = 0 at the bonus
    position) and d_1..d_T the drafts, let
      w_0 = 1,  w_j = min(1, w_{j-1} p_{j-1}(d_j) / q_{j-1}(d_j)),
      r_j = max(0, w_j p_j - q_j) (unnormalised, over the vocabulary),  rho_j = sum(r_j),
      h_j = rho_j / (rho_j + 1 - w_j) (0 where rho_j = 0),  for j = 1..T.
    With independent u_j ~ U[0, 1), the rule keeps the longest prefix j with u_j < h_j (none: j = 0) and
    emits a sample of normalise(r_j) after it: r_0 = max(0, p_0 - q_0) is the token-by-token rule's
    residual, and r_T = w_T p_T (no draft at the bonus position) draws from p_T. For T = 1 the rule is
    token-by-token speculative sampling. p is the target's distribution under `params`; at temperature 0
    it is one-hot and the result is greedy verification.

    Args:
      key: one PRNG key, or [B] row keys.
      draft_tokens: [B, T] int drafts; d_i must have been sampled from q_i (given the drafts before it, if
        the drafter conditions on them).
      draft_log_probs: [B, T, V] log q_i, the drafter's distribution that d_i was sampled from.
      target_logits: [B, T + 1, V] target logits for the block.
      params: the target's sampling settings.

    Returns:
      The kept drafts followed by the residual sample after them.
    """
    key_accept, key_residual = split_keys(key)
    draft_tokens = draft_tokens.astype(jnp.int32)
    p = jnp.exp(target_log_probs(target_logits, params))  # [B, T + 1, V]
    q = jnp.exp(draft_log_probs.astype(jnp.float32))  # [B, T, V]
    q = jnp.pad(q, ((0, 0), (0, 1), (0, 0)))  # [B, T + 1, V]: no draft at the bonus position
    p_draft = jnp.take_along_axis(p[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]  # [B, T]
    q_draft = jnp.take_along_axis(q[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]  # [B, T]

    weights = [jnp.ones(draft_tokens.shape[:1], jnp.float32)]  # w_0, [B]
    for i in range(draft_tokens.shape[1]):
        scaled = weights[-1] * p_draft[:, i]
        # min(1, scaled / q) without the division where it is 1, so q == 0 cannot produce NaN.
        weights.append(jnp.where(scaled >= q_draft[:, i], 1.0, scaled / jnp.maximum(q_draft[:, i], 1e-30)))
    w = jnp.stack(weights, axis=1)  # [B, T + 1]
    residual = jnp.maximum(w[..., None] * p - q, 0.0)  # [B, T + 1, V]
    mass = jnp.sum(residual, axis=-1)  # [B, T + 1]
    stop = jnp.where(mass > 0, mass / jnp.maximum(mass + 1.0 - w, 1e-30), 0.0)[:, 1:]  # h_1..h_T, [B, T]
    u = uniform(key_accept, draft_tokens.shape)  # [B, T], in [0, 1)
    position = jnp.arange(1, draft_tokens.shape[1] + 1)  # [T]
    num_accepted = jnp.max(jnp.where(u < stop, position, 0), axis=1)  # [B]

    at = num_accepted[:, None, None]  # [B, 1, 1]
    next_residual = jnp.take_along_axis(residual, at, axis=1)[:, 0]  # [B, V]
    next_mass = jnp.take_along_axis(mass, num_accepted[:, None], axis=1)  # [B, 1]
    # A zero residual is only reached with probability 0 (p == q at position 0); p keeps the draw defined.
    p_next = jnp.take_along_axis(p, at, axis=1)[:, 0]  # [B, V]
    next_residual = jnp.where(next_mass > 0, next_residual, p_next)
    next_token = categorical(key_residual, jnp.where(next_residual > 0, jnp.log(next_residual), NEG_INF))
    next_tokens = jnp.broadcast_to(next_token[:, None], p.shape[:2])  # [B, T + 1], read at num_accepted
    return commit_tokens(draft_tokens, num_accepted, next_tokens)
