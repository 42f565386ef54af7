"""Prefill and the jitted decode loop: draft -> verify -> accept -> commit, inside one `lax.while_loop`.

Plain autoregressive decoding is this loop with a drafter that proposes nothing: the verified block is
just the last committed token, and the acceptance rule commits the one token sampled from the target.
Speculative methods plug a `Proposer` into the same step. A proposer returns a chain (verified causally by
the delta rule, or by block verification for sampled drafts) or a `DraftTree` (verified under its ancestor
mask by the tree delta rule, the accepted path's K/V then gathered into contiguous slots; see
dflax.decoding.tree). Either way the step commits a chain of tokens, and the drafter observes the
committed tokens with their target features.

Randomness is per row: row r at output index i uses fold_in(row_key[r], i), so a prompt's output does
not depend on which other prompts share its batch.

Glossary: B batch, P prompt bucket, S cache slots, M max new tokens (+ block headroom), n draft length
(chain) or node count (tree).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from dflax.decoding.acceptance import Acceptance, accept_block, accept_delta
from dflax.decoding.sampling import SamplingParams, sample, split_keys
from dflax.decoding.tree import (
    DraftTree,
    accept_tree,
    ancestor_mask,
    compact_path,
    depths,
    gather_path,
    with_root,
)
from dflax.models.cache import KVCache, write_rows
from dflax.models.packing import Packing
from dflax.models.transformer import Transformer


class Proposer(Protocol):
    """A drafter as the decode loop sees it (static; its parameters travel as a traced pytree).

    Attributes:
      num_draft: n, draft tokens (chain) or nodes (tree) proposed per step (static).
      tap_layers: target layers whose output hidden states the drafter reads (HF hidden_states[l + 1]).
    """

    num_draft: int
    tap_layers: tuple[int, ...]

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype) -> Any:
        """The drafter's own loop state (e.g. its context KV cache), empty."""

    def observe(
        self,
        params: Any,
        drafter_state: Any,
        tokens: jax.Array,
        taps: tuple,
        positions: jax.Array,
        count: jax.Array,
    ) -> Any:
        """Adds the first `count` [B] of `tokens` [B, T], at `positions` [B, T], with their target taps
        (one [B, T, D] per tap layer): tokens whose K/V the target's cache now holds."""

    def propose(
        self, params: Any, target_params: dict, state: DecodeState, key: jax.Array
    ) -> tuple[jax.Array | DraftTree, jax.Array | None]:
        """A chain of draft tokens [B, n] and, when they were sampled from q, log q [B, n, V] (else None);
        or a `DraftTree` of n nodes (deterministic drafts only) and None.

        A proposer may also define `worth_verifying(params, state) -> [B] bool`: a step where no active
        row's drafts are worth it runs the plain one-token step instead of proposing and verifying (the
        plain step samples the target as plain decoding does, so the output is unchanged)."""


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries, as one pytree.

    Attributes:
      cache: target KV cache; `lengths` counts committed tokens whose K/V are in the cache.
      last_token: [B] the newest committed token (its K/V are not in the cache yet).
      tokens: [B, M] generated tokens; entries at or beyond `num_generated` are unspecified.
      num_generated: [B] int32 tokens generated so far (EOS included).
      max_new: [B] int32 per-row budget of new tokens.
      done: [B] bool, row finished (EOS or budget).
      row_keys: [B] PRNG keys, one per row.
      eos_ids: [E] int32 token ids that end a row.
      steps: [B] int32 verify steps taken while the row was active.
      accept_hist: [B, n + 2] int32, histogram of tokens committed per step (index = count; with a
        tree, count = the accepted path's depth + 1).
      drafter_state: the proposer's own state (None for plain decoding).
    """

    cache: KVCache
    last_token: jax.Array
    tokens: jax.Array
    num_generated: jax.Array
    max_new: jax.Array
    done: jax.Array
    row_keys: jax.Array
    eos_ids: jax.Array
    steps: jax.Array
    accept_hist: jax.Array
    drafter_state: Any = None


def _is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def _row_keys_at(row_keys: jax.Array, index: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in)(row_keys, index)


def prefill(
    model: Transformer,
    params: dict,
    prompt_tokens: jax.Array,
    prompt_lens: jax.Array,
    cache: KVCache,
    max_new: jax.Array,
    row_keys: jax.Array,
    eos_ids: jax.Array,
    sampling: SamplingParams,
    drafter_params: Any = None,
    *,
    max_tokens: int,
    proposer: Proposer | None = None,
    packed_tokens: int | None = None,
) -> DecodeState:
    """Runs the prompts through the target and samples each row's first token.

    Args:
      model: the target module.
      params: its parameters.
      prompt_tokens: [B, P] int32, right-padded prompts.
      prompt_lens: [B] int32 true prompt lengths (>= 1).
      cache: an empty cache with S >= P + max_tokens + max_draft + 1 slots.
      max_new: [B] int32 new-token budget per row (0 for padding rows).
      row_keys: [B] PRNG keys.
      eos_ids: [E] int32.
      sampling: target sampling settings.
      drafter_params: the proposer's parameters (None for plain decoding).
      max_tokens: static size M of the output buffer (>= max(max_new)).
      proposer: the drafter of the steps that follow (None for plain decoding); it observes the prompt.
      packed_tokens: static L >= sum(prompt_lens): run the token-wise work on the real prompt tokens
        packed into L slots instead of all B x P (see dflax.models.packing); None = unpacked.

    Returns:
      The initial decode state.
    """
    b, p = prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    taps_wanted = proposer.tap_layers if proposer else ()
    packing = None if packed_tokens is None else Packing.of_lengths(prompt_lens, p, packed_tokens)
    hidden, cache, taps = model.apply(
        params, prompt_tokens, positions, cache, None, taps_wanted, empty_cache=True, packing=packing
    )  # new_mask None: causal by index
    if packing is None:
        last_hidden = jnp.take_along_axis(hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    else:  # row r's last token is packed at sum(prompt_lens[:r + 1]) - 1
        last_hidden = hidden[0, jnp.cumsum(prompt_lens) - 1]  # [B, D]
        taps = tuple(packing.unpack(tap[0]) for tap in taps)  # [B, P, D] each
    drafter_state = None
    if proposer:
        drafter_state = proposer.init_state(b, cache.max_len, cache.dtype)
        drafter_state = proposer.observe(
            drafter_params, drafter_state, prompt_tokens, taps, positions, prompt_lens
        )
    cache = cache.replace(lengths=prompt_lens.astype(jnp.int32))
    return first_state(
        model, params, last_hidden, cache, max_new, row_keys, eos_ids, sampling, drafter_state,
        max_tokens=max_tokens, proposer=proposer,
    )  # fmt: skip


def first_state(
    model: Transformer,
    params: dict,
    last_hidden: jax.Array,
    cache: KVCache,
    max_new: jax.Array,
    row_keys: jax.Array,
    eos_ids: jax.Array,
    sampling: SamplingParams,
    drafter_state: Any,
    *,
    max_tokens: int,
    proposer: Proposer | None,
) -> DecodeState:
    """The decode state after a prefill: samples each row's first token from its last prompt token.

    Args:
      model, params: the target.
      last_hidden: [B, D] final hidden state of each row's last prompt token.
      cache: the cache holding the prompts (lengths set).
      max_new, row_keys, eos_ids, sampling, max_tokens, proposer: as in `prefill`.
      drafter_state: the proposer's state after observing the prompts (None for plain decoding); a
        proposer that defines `start_decoding(drafter_state)` gets it here, once the whole prompt
        (shared prefix included) is observed, so it can tell prompt observes from verified steps.
    """
    start_decoding = getattr(proposer, "start_decoding", None)
    if start_decoding is not None:
        drafter_state = start_decoding(drafter_state)
    b = last_hidden.shape[0]
    logits = model.apply(params, last_hidden, method=Transformer.logits)  # [B, V]
    keys = _row_keys_at(row_keys, jnp.zeros((b,), jnp.int32))
    first = sample(keys, logits, sampling)  # [B]
    n = proposer.num_draft if proposer else 0
    tokens = jnp.zeros((b, max_tokens + n + 1), jnp.int32).at[:, 0].set(first)
    return DecodeState(
        cache=cache,
        last_token=first,
        tokens=tokens,
        num_generated=jnp.ones((b,), jnp.int32),
        max_new=max_new,
        done=_is_eos(first, eos_ids) | (max_new <= 1),
        row_keys=row_keys,
        eos_ids=eos_ids,
        steps=jnp.zeros((b,), jnp.int32),
        accept_hist=jnp.zeros((b, n + 2), jnp.int32),
        drafter_state=drafter_state,
    )


@struct.dataclass
class Verified:
    """One verify forward and its acceptance, laid out as a chain whatever the draft's shape.

    Attributes:
      cache: the target cache with the committed tokens' K/V at slots [lengths, lengths + count)
        (`lengths` not advanced yet).
      acceptance: the committed tokens [B, n + 1] and the number of accepted drafts.
      tokens: [B, n + 1] the verified tokens in committed order (last token, then the accepted drafts).
      taps: one [B, n + 1, D] per tap layer, the target's features of `tokens`.
      positions: [B, n + 1] int32 absolute positions of `tokens`.
    """

    cache: KVCache
    acceptance: Acceptance
    tokens: jax.Array
    taps: tuple
    positions: jax.Array


def _verify_chain(model, params, state, drafts, draft_log_probs, sampling, keys, taps_wanted) -> Verified:
    """Verifies the chain [last token, drafts] [B, n + 1] with a causal mask (delta rule, or block
    verification for sampled drafts)."""
    n = drafts.shape[1]
    block = jnp.concatenate([state.last_token[:, None], drafts], axis=1)  # [B, n + 1]
    positions = state.cache.positions[:, None] + jnp.arange(n + 1, dtype=jnp.int32)  # [B, n + 1]
    # new_mask None: causal by index
    hidden, cache, taps = model.apply(params, block, positions, state.cache, None, taps_wanted)
    logits = model.apply(params, hidden, method=Transformer.logits)  # [B, n + 1, V]
    if draft_log_probs is None:
        acc = accept_delta(keys, drafts, logits, sampling)
    else:
        acc = accept_block(keys, drafts, draft_log_probs, logits, sampling)
    return Verified(cache, acc, block, taps, positions)


def _verify_tree(model, params, state, tree, draft_log_probs, sampling, keys, taps_wanted) -> Verified:
    """Verifies [last token, tree nodes] [B, N + 1] under their ancestor mask (tree delta rule), then
    moves the accepted path's K/V to contiguous slots."""
    if draft_log_probs is not None:
        raise ValueError(
            "a draft tree is verified by the tree delta rule, which needs drafts chosen without sampling; "
            "propose deterministic (argmax / top-k) trees, or sampled drafts as a chain"
        )
    tokens, parents = with_root(tree, state.last_token)  # [B, N + 1]
    mask = ancestor_mask(parents)  # [B, N + 1, N + 1]
    positions = state.cache.positions[:, None] + depths(mask)  # [B, N + 1]
    hidden, cache, taps = model.apply(params, tokens, positions, state.cache, mask, taps_wanted)
    logits = model.apply(params, hidden, method=Transformer.logits)  # [B, N + 1, V]
    acc, path = accept_tree(keys, tree, state.last_token, logits, sampling)
    path_positions = state.cache.positions[:, None] + jnp.arange(path.shape[1], dtype=jnp.int32)
    path_taps = tuple(gather_path(tap, path) for tap in taps)
    return Verified(compact_path(cache, path), acc, gather_path(tokens, path), path_taps, path_positions)


def decode_step(
    model: Transformer,
    params: dict,
    state: DecodeState,
    sampling: SamplingParams,
    drafter_params: Any = None,
    proposer: Proposer | None = None,
) -> DecodeState:
    """One draft -> verify -> accept -> commit step for every row.

    With a proposer that defines `worth_verifying`, a step where no active row's drafts are worth a verify
    is a plain one-token step (the drafter still observes the committed token).

    Args:
      model: the target module.
      params: its parameters.
      state: the loop state.
      sampling: target sampling settings.
      drafter_params: the proposer's parameters.
      proposer: the drafter (None for plain decoding: n = 0).

    Returns:
      The state after committing between 1 and n + 1 tokens per active row.
    """
    worth_verifying = getattr(proposer, "worth_verifying", None)
    if worth_verifying is None:
        return _step(model, params, state, sampling, drafter_params, proposer, drafts=True)
    wanted = jnp.any(worth_verifying(drafter_params, state) & ~state.done)
    # Two loops of at most one iteration each rather than lax.cond: XLA updates a while loop's carried
    # cache in place, where each branch of a conditional copies it (tests/decoding/test_cache_in_place.py).
    def once(drafts: bool):
        return lambda carry: (
            _step(model, params, carry[0], sampling, drafter_params, proposer, drafts),
            jnp.asarray(False),
        )

    state = jax.lax.while_loop(lambda carry: carry[1], once(False), (state, ~wanted))[0]
    return jax.lax.while_loop(lambda carry: carry[1], once(True), (state, wanted))[0]


def _step(
    model: Transformer,
    params: dict,
    state: DecodeState,
    sampling: SamplingParams,
    drafter_params: Any,
    proposer: Proposer | None,
    drafts: bool,
) -> DecodeState:
    """`decode_step` proposing and verifying drafts, or (drafts=False) verifying the last token alone."""
    b = state.last_token.shape[0]
    keys = _row_keys_at(state.row_keys, state.num_generated)
    accept_keys, draft_keys = split_keys(keys)
    if proposer is None or not drafts:
        chain, draft_log_probs = jnp.zeros((b, 0), jnp.int32), None
    else:
        chain, draft_log_probs = proposer.propose(drafter_params, params, state, draft_keys)  # [B, n]
    taps_wanted = proposer.tap_layers if proposer else ()
    verify = _verify_tree if isinstance(chain, DraftTree) else _verify_chain
    verified = verify(model, params, state, chain, draft_log_probs, sampling, accept_keys, taps_wanted)
    cache, committed, count = verified.cache, verified.acceptance.tokens, verified.acceptance.num_accepted + 1
    n = committed.shape[1] - 1

    # Stop at the first EOS among the committed tokens and at the row's budget.
    idx = jnp.arange(n + 1)
    eos_at = jnp.where(_is_eos(committed, state.eos_ids) & (idx < count[:, None]), idx, n + 1).min(axis=1)
    budget = state.max_new - state.num_generated
    emitted = jnp.minimum(jnp.minimum(count, eos_at + 1), budget)
    active = ~state.done
    emitted = jnp.where(active, emitted, 0)
    finished = active & ((eos_at < count) | (emitted >= budget))

    last = jnp.take_along_axis(committed, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    drafter_state = state.drafter_state
    if proposer is not None:
        # The block's target features come free from the verify pass: the drafter keeps those of the
        # committed tokens (the last committed token and the accepted drafts, along the accepted path).
        drafter_state = proposer.observe(
            drafter_params,
            drafter_state,
            verified.tokens,
            verified.taps,
            verified.positions,
            jnp.where(active, count, 0),
        )
    return state.replace(
        cache=cache.replace(lengths=cache.lengths + jnp.where(active, count, 0)),
        last_token=jnp.where(active, last, state.last_token),
        tokens=jnp.where(
            active[:, None], write_rows(state.tokens, committed, state.num_generated), state.tokens
        ),
        num_generated=state.num_generated + emitted,
        done=state.done | finished,
        steps=state.steps + active,
        accept_hist=state.accept_hist
        + jax.nn.one_hot(count, state.accept_hist.shape[1], dtype=jnp.int32) * active[:, None],
        drafter_state=drafter_state,
    )


def decode_loop(
    model: Transformer,
    params: dict,
    state: DecodeState,
    sampling: SamplingParams,
    drafter_params: Any = None,
    proposer: Proposer | None = None,
) -> DecodeState:
    """Runs `decode_step` until every row is done, without returning to Python.

    Args:
      model: the target module.
      params: its parameters.
      state: from `prefill`.
      sampling: target sampling settings.
      drafter_params: the proposer's parameters.
      proposer: the drafter (None = plain decoding).

    Returns:
      The final state; row r's output is tokens[r, :num_generated[r]].
    """
    return jax.lax.while_loop(
        lambda s: jnp.any(~s.done),
        lambda s: decode_step(model, params, s, sampling, drafter_params, proposer),
        state,
    )
