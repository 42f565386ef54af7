"""DiffuSpec: a masked diffusion LM drafts a window in one forward (arXiv 2510.02358), lossless at any
temperature.

Each step the diffusion LM (any `dflax.diffusion.DiffusionLM`) fills K masked slots after the committed
prefix in R forwards (dflax.diffusion.refine); the token lattice of its per-slot distributions
(dflax.diffusion.lattice) is searched left to right by CPS with a 3-gram prior (dflax.diffusion.cps), and
the best path is the draft chain. ADL (dflax.diffusion.adl) sets each row's draft length k from its
recent generated and accepted lengths. The chain is chosen without sampling, so the delta rule verifies
it at every temperature (design/verification.md): the target's own samples decide, the drafter's
probabilities never enter acceptance.

Static shapes: every step verifies K = `window` drafts. Drafts a row may not use are replaced by ids no
target sample can equal, so acceptance stops before them: NO_DRAFT_PAST_K past the row's k, and
NO_DRAFT_AFTER_EOS after the chain's first EOS (nothing after an EOS is ever emitted). `observe` reads
these markers back from the verified chain to learn L_gen (the tokens before the first EOS) for ADL;
the prefill's `observe` (the prompt, no drafts) does not update ADL. One inexactness: an EOS drafted at
the very last slot K - 1 with k = K counts L_gen = K instead of K - 1 (no slot follows to mark it).

Glossary: B batch, S history slots (the target cache's), K window slots, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dflax.decoding.sampling import first_argmax
from dflax.diffusion.adl import ADL_MAX, ADL_MIN, AdlSettings, AdlState, next_draft_length, update
from dflax.diffusion.cps import CPS_BEAM_WIDTH, CPS_NGRAM_WEIGHT, cps_path
from dflax.diffusion.lattice import LATTICE_MASS, LATTICE_MAX_SET, token_lattice
from dflax.diffusion.protocol import DiffusionLM
from dflax.diffusion.refine import window_log_probs
from dflax.drafters.dart_tree import NgramPrior
from dflax.drafters.ngram import NgramTable
from dflax.models.cache import write_rows

NO_DRAFT_PAST_K = -1
NO_DRAFT_AFTER_EOS = -2


@struct.dataclass
class DiffuSpecParams:
    """What the proposer reads besides its static settings.

    Attributes:
      model: the diffusion LM's parameters.
      ngram: corpus n-gram priors for CPS, longest order first (empty: the row's own text only).
    """

    model: Any
    ngram: tuple[NgramPrior, ...] = ()


@struct.dataclass
class DiffuSpecState:
    """The proposer's loop state.

    Attributes:
      model: the diffusion LM's state of the committed prefix.
      history: [B, S] int32 committed tokens by position (CPS's own n-gram counts read them).
      adl: per-row ADL averages.
      drafting: [B] bool, the row has observed its prompt (later observes follow a verified draft).
    """

    model: Any
    history: jax.Array
    adl: AdlState
    drafting: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class DiffuSpecProposer:
    """DiffuSpec as the decode loop's `Proposer` (static; parameters are `DiffuSpecParams`).

    Attributes:
      model: the diffusion LM (shares the target's tokenizer).
      window: K, slots drafted and verified per step (ADL's k never exceeds it; by default k_max = K).
      refine_steps: R, diffusion forwards per draft.
      cps: search the lattice (True) or take each slot's most likely token (False).
      adl: the ADL controller's settings, or None for a fixed k = window.
      lattice_mass, lattice_max_set: the lattice's top-set rule.
      beam_width, ngram_weight: CPS's beam width and n-gram weight.
      vocab_size: drafts are ids below this (the target's vocabulary; a diffusion LM with a padded, wider
        vocabulary drafts from its first `vocab_size` logits); None = the diffusion LM's.
    """

    model: DiffusionLM
    window: int = ADL_MAX
    refine_steps: int = 1
    cps: bool = True
    adl: AdlSettings | None = AdlSettings()
    lattice_mass: float = LATTICE_MASS
    lattice_max_set: int = LATTICE_MAX_SET
    beam_width: int = CPS_BEAM_WIDTH
    ngram_weight: float = CPS_NGRAM_WEIGHT
    vocab_size: int | None = None
    tap_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"the DiffuSpec window must hold at least one slot, got {self.window}")
        if not 1 <= self.refine_steps <= self.window:
            raise ValueError(
                f"refine steps must be in [1, window={self.window}] (one forward fixes at least one slot), "
                f"got {self.refine_steps}"
            )
        if self.adl is not None and self.adl.k_max > self.window:
            raise ValueError(
                f"ADL's k_max ({self.adl.k_max}) exceeds the window verified per step ({self.window}); "
                f"set window >= {self.adl.k_max}"
            )

    @property
    def num_draft(self) -> int:
        """K: drafts verified per step (a static chain)."""
        return self.window

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype) -> DiffuSpecState:
        """The diffusion LM's empty state, an empty history, ADL averages at k_max."""
        return DiffuSpecState(
            model=self.model.init_state(batch, slots, dtype),
            history=jnp.zeros((batch, slots), jnp.int32),
            adl=AdlState.init(batch, self.adl or AdlSettings(self.window, self.window)),
            drafting=jnp.zeros((batch,), jnp.bool_),
        )

    def draft_lengths(self, state: DiffuSpecState) -> jax.Array:
        """k [B] int32 of the next draft: ADL's choice, or the window."""
        if self.adl is None:
            return jnp.full(state.drafting.shape, self.window, jnp.int32)
        return next_draft_length(state.adl, self.adl)

    def observe(self, params, state: DiffuSpecState, tokens, taps, positions, count) -> DiffuSpecState:
        """Passes the committed tokens to the diffusion LM, records them, and after a verify step updates
        ADL with L_gen (read from the chain's markers) and L_acc = count - 1."""
        clean = jnp.maximum(tokens, 0)  # markers only stand past `count`: padding for the diffusion LM
        model_state = self.model.observe(params.model, state.model, clean, positions, count)
        history = write_rows(state.history, clean, positions[:, 0])
        adl = state.adl
        if self.adl is not None:
            drafts = tokens[:, 1:]  # [B, K] on a verify step: the chain as proposed
            index = jnp.arange(drafts.shape[1])
            first = jnp.min(jnp.where(drafts < 0, index, drafts.shape[1]), axis=1)  # [B]
            marker = jnp.take_along_axis(drafts, jnp.minimum(first, drafts.shape[1] - 1)[:, None], 1)[:, 0]
            after_eos = (first < drafts.shape[1]) & (marker == NO_DRAFT_AFTER_EOS)
            generated = jnp.where(after_eos, first - 1, first)
            active = state.drafting & (count > 0)
            adl = update(adl, generated, jnp.maximum(count - 1, 0), active, self.adl)
        return DiffuSpecState(model_state, history, adl, state.drafting)

    def start_decoding(self, state: DiffuSpecState) -> DiffuSpecState:
        """After the prompt (a shared prefix and the row's own part are two observes): every later observe
        follows a verified chain, so ADL counts it."""
        return state.replace(drafting=jnp.ones_like(state.drafting))

    def propose(self, params, target_params, state, keys) -> tuple[jax.Array, None]:
        """The draft chain [B, K]: CPS's best path (or the per-slot argmax), with markers past each row's k
        and after its first EOS."""
        ds: DiffuSpecState = state.drafter_state
        length = state.cache.positions  # [B] committed tokens held; the last token sits at `length`
        log_q = window_log_probs(
            self.model,
            params.model,
            ds.model,
            state.last_token,
            length,
            self.window,
            self.refine_steps,
            self.vocab_size,
        )  # [B, K, V]
        if self.cps:
            lattice = token_lattice(log_q, state.eos_ids, self.lattice_mass, self.lattice_max_set)
            text = write_rows(ds.history, state.last_token[:, None], length)  # [B, S], valid to length + 1
            drafts, _ = cps_path(lattice, text, length + 1, params.ngram, self.beam_width, self.ngram_weight)
        else:
            drafts = first_argmax(log_q)
        return mark_unusable(drafts, self.draft_lengths(ds), state.eos_ids), None


def mark_unusable(drafts: jax.Array, k: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """Drafts [B, K] with NO_DRAFT_PAST_K from slot k [B] on, then NO_DRAFT_AFTER_EOS after the first EOS."""
    index = jnp.arange(drafts.shape[1])
    is_eos = jnp.any(drafts[..., None] == eos_ids, axis=-1)  # [B, K]
    first_eos = jnp.min(jnp.where(is_eos, index, drafts.shape[1]), axis=1)  # [B]
    drafts = jnp.where(index >= k[:, None], NO_DRAFT_PAST_K, drafts)
    return jnp.where(index > first_eos[:, None], NO_DRAFT_AFTER_EOS, drafts).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class DiffuSpecDrafter:
    """A diffusion LM bound as DiffuSpec's drafter for `dflax.generate(..., drafter=)`.

    Attributes:
      name: where it came from.
      params: the proposer's parameters.
      proposer: the static proposer.
    """

    name: str
    params: DiffuSpecParams
    proposer: DiffuSpecProposer

    def with_settings(self, window: int, adl_bounds: tuple[int, int] | None, cps: bool) -> DiffuSpecDrafter:
        """The same diffusion LM drafting a window of `window` slots, ADL within `adl_bounds` (None: k =
        window), with or without CPS."""
        adl = AdlSettings(*adl_bounds) if adl_bounds else None
        proposer = dataclasses.replace(self.proposer, window=window, adl=adl, cps=cps)
        return dataclasses.replace(self, proposer=proposer)

    def with_tree_budget(self, tree_budget: int) -> DiffuSpecDrafter:
        """DiffuSpec verifies one chain: only 0 (a chain) is accepted."""
        if tree_budget:
            raise ValueError(
                "DiffuSpec verifies a chain (CPS's best path); leave out tree_budget / --tree-budget"
            )
        return self


def diffuspec(
    model: DiffusionLM,
    params: Any,
    *,
    window: int = ADL_MAX,
    refine_steps: int = 1,
    cps: bool = True,
    adl: bool = True,
    adl_min: int = ADL_MIN,
    adl_max: int | None = None,
    ngram: tuple[NgramTable, ...] = (),
    vocab_size: int | None = None,
    name: str = "diffuspec",
) -> DiffuSpecDrafter:
    """A DiffuSpec drafter from a diffusion LM and its parameters.

    Args:
      model: a `dflax.diffusion.DiffusionLM` sharing the target's tokenizer (vocabulary ids).
      params: its parameters.
      window: K, slots drafted and verified per step (ADL's k_max; published 30).
      refine_steps: R diffusion forwards per draft (published 1).
      cps: causal-consistency path search over the lattice (False: each slot's most likely token).
      adl: adaptive draft length k in [adl_min, window] (False: k = window every step).
      adl_min: ADL's lower clip bound (published 20; capped at adl_max).
      adl_max: ADL's upper clip bound (published 30; default and at most the window).
      ngram: corpus n-gram tables (orders 2 and 3, dflax.drafters.ngram) for CPS's prior, besides the
        row's own text.
      vocab_size: the target's vocabulary size when the diffusion LM's is wider (padded); drafts stay
        below it. None = the diffusion LM's own.
      name: how results name the drafter.

    Raises:
      ValueError: for a window < 1, refine steps outside [1, window], ADL bounds outside [1, window] or
        n-gram orders other than 2 and 3.
    """
    bad = [t.order for t in ngram if t.order not in (2, 3)]
    if bad:
        raise ValueError(f"CPS's prior reads trigram and bigram counts; got n-gram orders {bad}")
    priors = tuple(NgramPrior.from_table(t) for t in sorted(ngram, key=lambda t: -t.order))
    k_max = window if adl_max is None else adl_max
    settings = AdlSettings(min(adl_min, k_max), k_max) if adl else None
    proposer = DiffuSpecProposer(model, window, refine_steps, cps, settings, vocab_size=vocab_size)
    return DiffuSpecDrafter(name, DiffuSpecParams(params, priors), proposer)
