"""Batched generation: prompts in, text + token ids + stats out.

Prompts are bucketed to static shapes (batch, prompt length, cache length), so a shape compiles once and
is reused for every later batch that falls in the same bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from dflax.decoding.decode import Proposer, decode_loop, prefill
from dflax.decoding.sampling import SamplingParams
from dflax.decoding.shared_prefix import PrefixGroup, prefill_shared, share_groups
from dflax.models.cache import KVCache
from dflax.sharding import ShardingRules
from dflax.sharding.multihost import to_host
from dflax.sharding.placement import padded_batch, place_replicated, place_rows, sharded_cache
from dflax.sharding.programs import sharded_generation
from dflax.target import Target
from pallas_kernels.shared_prefix import GroupLayout

if TYPE_CHECKING:
    from dflax.drafters import DartDrafterBound, Drafter, LookupDrafter

Prompt = str | list[dict[str, str]]
_MIN_PROMPT_BUCKET = 16
SHARED_PREFIX_MODES = ("auto", "none")


class PromptTooLongError(ValueError):
    """A prompt plus its new-token budget does not fit the model's context."""


@dataclasses.dataclass
class GenerationResult:
    """One prompt's output.

    Attributes:
      text: the generated text (special tokens removed).
      tokens: generated token ids (EOS included when it was produced).
      stats: prompt_tokens, new_tokens, steps (verify steps), tau, accept_hist (steps by tokens committed:
        index 1 + accepted drafts, the accepted depth + 1 with trees), finish_reason,
        prefill_s / decode_s (of the batch the prompt ran in), batch_size.
    """

    text: str
    tokens: list[int]
    stats: dict[str, Any]


def encode_prompt(target: Target, prompt: Prompt) -> list[int]:
    """Token ids of a raw-completion string or a chat message list (via the model's chat template)."""
    if isinstance(prompt, str):
        return target.tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        return target.tokenizer.encode_chat(prompt)
    raise TypeError(
        "a prompt must be a string (raw completion) or a list of {'role': ..., 'content': ...} messages, "
        f"got {type(prompt).__name__}"
    )


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prompt_bucket(longest: int) -> int:
    """The static prompt length P for prompts of at most `longest` tokens (a power of two, >= 16)."""
    return max(_MIN_PROMPT_BUCKET, next_pow2(longest))


def cache_slots(bucket_p: int, max_new_tokens: int, proposer: Proposer | None) -> int:
    """Cache slots S for a prompt bucket and budget.

    Headroom: a verify step writes n + 1 slots past the committed length. Slots follow the prompt bucket
    (one decode compile per bucket); empty slots cost nothing to the attention on any backend.
    """
    return _round_up(bucket_p + max_new_tokens + (proposer.num_draft if proposer else 0) + 1, 64)


def packed_bucket(tokens: int, rows: int, length: int) -> int | None:
    """The static pack size for `tokens` real prompt tokens of a [rows, length] bucket, or None when packing
    would not save work. Sizes are multiples of an eighth of the next power of two (at least 16): at most
    four sizes (compiles) per octave, at most 1.25x the need."""
    size = _round_up(tokens, max(_MIN_PROMPT_BUCKET, next_pow2(tokens) // 8))
    return size if size < rows * length else None


def fit_to_context(
    ids: list[int], max_new_tokens: int, context: int, truncate: bool, label: str
) -> list[int]:
    """Checks that a prompt plus its budget fits the context; keeps the last tokens when truncating.

    Raises:
      PromptTooLongError: when it does not fit and truncate is False, or when it is empty.
    """
    if not ids:
        raise PromptTooLongError(f"prompt {label} is empty after tokenization; give it some text")
    room = context - max_new_tokens
    if room < 1:
        raise PromptTooLongError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the {context}-token context; "
            "lower max_new_tokens"
        )
    if len(ids) <= room:
        return ids
    if truncate:
        return ids[-room:]
    raise PromptTooLongError(
        f"prompt {label} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} the context of "
        f"{context} tokens allows {room}. Shorten the prompt, lower max_new_tokens, or pass truncate=True "
        f"(CLI: --truncate) to keep the last {room} prompt tokens"
    )


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_programs(target: Target, proposer: Proposer | None) -> tuple[Callable, Callable]:
    """Jitted prefill and decode loop of a target and drafter (jit keeps one executable per shape)."""
    per_target = _COMPILED.setdefault(target, {})
    if proposer not in per_target and target.mesh is not None:
        per_target[proposer] = sharded_generation(target.module, _rules(target), proposer)
    if proposer not in per_target:
        prefill_fn = jax.jit(
            functools.partial(prefill, target.module, proposer=proposer),
            static_argnames=("max_tokens", "packed_tokens"),
            donate_argnames=("cache",),
        )
        decode_fn = jax.jit(
            functools.partial(decode_loop, target.module, proposer=proposer), donate_argnames=("state",)
        )
        per_target[proposer] = (prefill_fn, decode_fn)
    return per_target[proposer]


_COMPILED_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_shared_prefill(target: Target, proposer: Proposer | None) -> Callable:
    """Jitted `prefill_shared` of a target and drafter (its decode loop is `compiled_programs`')."""
    per_target = _COMPILED_SHARED.setdefault(target, {})
    if proposer not in per_target:
        per_target[proposer] = jax.jit(
            functools.partial(prefill_shared, target.module, proposer=proposer),
            static_argnames=("max_tokens", "packed_prefix", "packed_own"),
            donate_argnames=("cache",),
        )
    return per_target[proposer]


def can_share_prefix(target: Target) -> bool:
    """Shared prefixes need a single device and global attention in every layer."""
    return target.mesh is None and target.config.sliding_window is None


def _rules(target: Target) -> ShardingRules:
    """The sharding rules of a target loaded on a mesh."""
    return ShardingRules.for_model(target.config, target.mesh)


def generate_ids(
    target: Target,
    prompt_ids: Sequence[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    row_seeds: Sequence[int],
    batch_size: int,
    drafter: Drafter | DartDrafterBound | LookupDrafter | None = None,
    warmup: bool = False,
    shared_prefix: str = "none",
) -> list[GenerationResult]:
    """Generates for one batch of already-encoded prompts (at most batch_size of them).

    Args:
      target: the loaded target.
      prompt_ids: token ids of each prompt, each fitting the context with max_new_tokens.
      max_new_tokens: budget per prompt.
      sampling: target sampling settings.
      row_seeds: one PRNG seed per prompt (the prompt's output depends only on its seed).
      batch_size: static batch size of the compiled step (rows beyond the prompts are padding).
      drafter: a speculative drafter, DFlash or prompt lookup (None = plain autoregressive decoding).
      warmup: only compile this batch's shapes (every row stops after its first token).
      shared_prefix: "auto" prefills and stores a common token prefix of consecutive prompts once per
        group of rows (`dflax.decoding.shared_prefix`; where no two prompts share enough, or the target
        cannot, nothing changes); "none" gives every row its whole prompt.

    Returns:
      One result per prompt, in order; stats add shared_prefix_tokens (the row's prompt tokens read from
      a shared prefix) and kv_cache_bytes (the batch's allocated target KV cache, shared prefixes included).
    """
    n = len(prompt_ids)
    bucket_b = min(batch_size, next_pow2(n))
    if target.mesh is not None:  # rows split evenly over the mesh's `data` axis
        bucket_b = padded_batch(bucket_b, _rules(target))
    if shared_prefix not in SHARED_PREFIX_MODES:
        raise ValueError(f"shared_prefix must be one of {SHARED_PREFIX_MODES}, got {shared_prefix!r}")
    groups = share_groups(prompt_ids) if shared_prefix == "auto" and can_share_prefix(target) else []
    offsets = np.zeros((bucket_b,), np.int32)  # each row's shared prefix length
    for group in groups:
        offsets[group.rows] = group.length
    own_ids = [ids[offsets[r] :] for r, ids in enumerate(prompt_ids)]
    bucket_p = prompt_bucket(max(len(ids) for ids in own_ids))
    proposer = drafter.proposer if drafter else None
    drafter_params = drafter.params if drafter else None
    slots = cache_slots(bucket_p, max_new_tokens, proposer)

    tokens = np.zeros((bucket_b, bucket_p), np.int32)
    lens = np.ones((bucket_b,), np.int32)
    budgets = np.zeros((bucket_b,), np.int32)
    seeds = np.zeros((bucket_b,), np.uint32)
    for r, ids in enumerate(own_ids):
        tokens[r, : len(ids)] = ids
        lens[r], budgets[r], seeds[r] = len(ids), 1 if warmup else max_new_tokens, row_seeds[r]
    packed = packed_bucket(int(lens.sum()), bucket_b, bucket_p)
    row_keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))
    eos = jnp.asarray(target.eos_ids, jnp.int32)
    inputs = (jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(budgets), row_keys)
    if target.mesh is None:
        cache = KVCache.init(target.config, bucket_b, slots, target.cache_dtype)
    else:  # rows split over `data`; packed prompts would mix rows of different devices
        rules, packed = _rules(target), None
        cache = sharded_cache(target.config, bucket_b, slots, target.cache_dtype, rules)
        inputs, (eos, sampling) = place_rows(rules, *inputs), place_replicated(rules, (eos, sampling))
    prompt_tokens, prompt_lens, budgets_in, row_keys = inputs

    prefill_fn, decode_fn = compiled_programs(target, proposer)
    t0 = time.perf_counter()
    if groups:
        shared_inputs = _shared_prefix_inputs(prompt_ids, groups, bucket_b, offsets)
        state = compiled_shared_prefill(target, proposer)(
            target.params,
            *shared_inputs,
            prompt_tokens,
            prompt_lens,
            cache,
            budgets_in,
            row_keys,
            eos,
            sampling,
            drafter_params,
            max_tokens=max_new_tokens,
            packed_prefix=packed_bucket(sum(group.length for group in groups), *shared_inputs[0].shape),
            packed_own=packed,
        )
    else:
        state = prefill_fn(
            target.params,
            prompt_tokens,
            prompt_lens,
            cache,
            budgets_in,
            row_keys,
            eos,
            sampling,
            drafter_params,
            max_tokens=max_new_tokens,
            packed_tokens=packed,
        )
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    state = decode_fn(target.params, state, sampling, drafter_params)
    jax.block_until_ready(state)
    t2 = time.perf_counter()

    # On a mesh spanning several processes each holds some rows' shards; every process gets all rows.
    rows = (state.tokens, state.num_generated, state.steps, state.accept_hist)
    out_tokens, num, steps, hist = map(to_host, rows)
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves((state.cache.k, state.cache.v)))
    if state.cache.shared is not None:
        kv_bytes += sum(x.nbytes for x in jax.tree.leaves((state.cache.shared.k, state.cache.shared.v)))
    results = []
    for r in range(n):
        result = result_of_row(
            target,
            out_tokens[r, : num[r]].tolist(),
            len(prompt_ids[r]),
            int(steps[r]),
            hist[r],
            t1 - t0,
            t2 - t1,
            n,
        )
        result.stats.update(shared_prefix_tokens=int(offsets[r]), kv_cache_bytes=kv_bytes)
        results.append(result)
    return results


def _shared_prefix_inputs(
    prompt_ids: Sequence[list[int]], groups: list[PrefixGroup], batch: int, offsets: np.ndarray
) -> tuple:
    """The static-shape prefix arrays of `prefill_shared`: (prefix tokens [G, L], prefix lengths [G],
    layout, row offsets [B]), G, L and the rows per group rounded up to powers of two (few compiles)."""
    num_groups = next_pow2(len(groups))
    length = prompt_bucket(max(1, max(group.length for group in groups)))
    prefix_tokens = np.zeros((num_groups, length), np.int32)
    prefix_lens = np.zeros((num_groups,), np.int32)
    for g, group in enumerate(groups):
        prefix_tokens[g, : group.length] = prompt_ids[group.rows[0]][: group.length]
        prefix_lens[g] = group.length
    rows = min(batch, next_pow2(max(len(group.rows) for group in groups)))
    layout = GroupLayout.of_groups([group.rows for group in groups], batch, num_groups, rows)
    return jnp.asarray(prefix_tokens), jnp.asarray(prefix_lens), layout, jnp.asarray(offsets)


def result_of_row(
    target: Target,
    ids: list[int],
    prompt_tokens: int,
    steps: int,
    hist: np.ndarray,
    prefill_s: float,
    decode_s: float,
    batch_size: int,
) -> GenerationResult:
    """One prompt's result from its row of the final decode state.

    Args:
      target: the target (tokenizer and EOS ids).
      ids: the row's generated tokens.
      prompt_tokens: its prompt length.
      steps: verify steps the row took.
      hist: [n + 2] its histogram of tokens committed per step.
      prefill_s, decode_s, batch_size: timing and batch of the run the row was part of.
    """
    committed_by_steps = int((hist * np.arange(hist.shape[0])).sum())
    stats = {
        "prompt_tokens": prompt_tokens,
        "new_tokens": len(ids),
        "steps": steps,
        "tau": committed_by_steps / steps if steps else 1.0,
        "accept_hist": hist.tolist(),
        "finish_reason": "eos" if ids and ids[-1] in set(target.eos_ids) else "length",
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "batch_size": batch_size,
    }
    return GenerationResult(target.tokenizer.decode(ids), ids, stats)


def generate(
    target: Target,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    truncate: bool = False,
    row_seeds: Sequence[int] | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
    drafter: Drafter | DartDrafterBound | LookupDrafter | None = None,
    tree_budget: int | None = None,
    refill_every: int | None = None,
    shared_prefix: str = "none",
) -> list[GenerationResult]:
    """Generates a completion for every prompt, plainly or speculatively (lossless either way).

    Args:
      target: from `dflax.load_target`.
      prompts: strings (raw completion) or chat message lists ([{"role": "user", "content": ...}]).
      max_new_tokens: new-token budget per prompt (> 0).
      temperature: 0 = greedy; > 0 samples.
      top_k: keep the k most likely tokens (0 = all).
      top_p: nucleus mass (1 = all).
      seed: base seed; prompt i uses seed + i unless row_seeds is given.
      batch_size: prompts decoded together.
      truncate: keep the last tokens of a prompt that does not fit the context instead of failing.
      row_seeds: explicit per-prompt seeds (a prompt's output depends only on its seed).
      on_result: called with (prompt index, result) as soon as each prompt is done.
      drafter: from `dflax.load_drafter` (DFlash or DART), `dflax.load_dart` or `dflax.prompt_lookup`;
        None decodes one token per target forward.
      tree_budget: N > 0 verifies a tree of N nodes each step (DFlash: best first over its block; DART:
        its n-gram-pruned beam; prompt lookup: the continuations of several occurrences) and 0 a chain;
        None keeps the drafter's own setting (a chain unless set).
      refill_every: None runs static batches (each until its longest row ends); k > 0 batches
        continuously: every k decode steps finished rows are refilled with waiting prompts
        (`dflax.continuous_batching`; on_result is then called in finishing order). Outputs are the same.
      shared_prefix: "auto" finds the longest common token prefix of consecutive prompts in a batch
        (a system message, a prompt repeated for several samples) and prefills and stores it once per
        group of rows; "none" stores every prompt per row. Outputs are the same either way. Static
        batches on one device only (refill_every=None, no mesh); "auto" on a sliding-window model
        shares nothing.

    Returns:
      One GenerationResult per prompt, in order.

    Raises:
      ValueError: for a non-positive max_new_tokens or batch_size, bad sampling settings, a tree budget
        without a drafter (or with sampled DFlash drafts), or a prompt that does not fit
        (PromptTooLongError). All prompts are checked before any is generated.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if refill_every is not None and refill_every < 1:
        raise ValueError(f"refill_every must be a positive number of steps (or None), got {refill_every}")
    if refill_every is not None and target.mesh is not None:
        raise ValueError(
            "continuous batching (refill_every) does not run on a mesh yet; use refill_every=None"
        )
    if shared_prefix not in SHARED_PREFIX_MODES:
        raise ValueError(f"shared_prefix must be one of {SHARED_PREFIX_MODES}, got {shared_prefix!r}")
    if shared_prefix == "auto" and (refill_every is not None or target.mesh is not None):
        raise ValueError(
            "shared_prefix='auto' runs static batches on one device; use refill_every=None and no mesh, "
            "or shared_prefix='none'"
        )
    sampling = SamplingParams.make(temperature, top_k, top_p)
    if tree_budget is not None:
        if drafter is None:
            raise ValueError(
                "tree_budget needs a drafter: drafter=dflax.load_drafter(...) (DFlash) or "
                "dflax.prompt_lookup(); plain decoding verifies one token per step"
            )
        drafter = drafter.with_tree_budget(tree_budget)
    seeds = list(row_seeds) if row_seeds is not None else [seed + i for i in range(len(prompts))]
    if len(seeds) != len(prompts):
        raise ValueError(f"row_seeds has {len(seeds)} entries for {len(prompts)} prompts")
    context = target.config.max_position_embeddings
    encoded = [
        fit_to_context(encode_prompt(target, p), max_new_tokens, context, truncate, f"#{i}")
        for i, p in enumerate(prompts)
    ]
    if refill_every is not None and encoded:
        from dflax.continuous_batching import generate_continuous

        return generate_continuous(
            target,
            encoded,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            row_seeds=seeds,
            batch_size=batch_size,
            refill_every=refill_every,
            drafter=drafter,
            on_result=on_result,
        )
    results: list[GenerationResult] = []
    for start in range(0, len(encoded), batch_size):
        chunk = range(start, min(start + batch_size, len(encoded)))
        batch = generate_ids(
            target,
            [encoded[i] for i in chunk],
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            row_seeds=[seeds[i] for i in chunk],
            batch_size=batch_size,
            drafter=drafter,
            shared_prefix=shared_prefix,
        )
        for i, result in zip(chunk, batch):
            if on_result is not None:
                on_result(i, result)
        results.extend(batch)
    return results
