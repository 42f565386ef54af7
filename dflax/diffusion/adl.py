"""DiffuSpec's adaptive draft length (ADL, arXiv 2510.02358), per row, under jit.

After every verify step a row records L_gen, the drafted tokens before the first EOS (at most k), and
L_acc, the drafts the target accepted. Both are averaged exponentially with rho = 0.5,

    avg <- rho * avg + (1 - rho) * L,

and the next draft length is

    k = clip(floor(avg L_gen) + 10 * [avg L_acc >= avg L_gen], k_min, k_max)

(published: [20, 30]). The averages start at k_max, as if a first full window had been drafted and
accepted, so the first step drafts k_max.

dflax verifies a static chain of k_max drafts (one compiled shape) and stops acceptance at k, so a
smaller k saves no verify compute here; see docs/diffuspec.md.

Glossary: B batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

ADL_RHO = 0.5
ADL_BONUS = 10
ADL_MIN = 20
ADL_MAX = 30


@dataclasses.dataclass(frozen=True)
class AdlSettings:
    """The controller's constants (the published ones by default).

    Attributes:
      k_min, k_max: the clip bounds of k (k_max is also the static window verified per step).
      rho: the exponential averages' weight on the past.
      bonus: added to floor(avg L_gen) while drafts are accepted as far as they are generated.
    """

    k_min: int = ADL_MIN
    k_max: int = ADL_MAX
    rho: float = ADL_RHO
    bonus: int = ADL_BONUS

    def __post_init__(self):
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(
                f"ADL bounds must satisfy 1 <= k_min <= k_max, got [{self.k_min}, {self.k_max}]; "
                "e.g. --window auto with the published [20, 30]"
            )
        if not 0 <= self.rho < 1:
            raise ValueError(f"ADL's rho must be in [0, 1), got {self.rho}")


@struct.dataclass
class AdlState:
    """Per-row exponential averages.

    Attributes:
      avg_gen: [B] float32 average L_gen.
      avg_acc: [B] float32 average L_acc.
    """

    avg_gen: jax.Array
    avg_acc: jax.Array

    @classmethod
    def init(cls, batch: int, settings: AdlSettings) -> AdlState:
        """Averages at k_max (the first step drafts k_max)."""
        start = jnp.full((batch,), float(settings.k_max), jnp.float32)
        return cls(start, start)


def next_draft_length(state: AdlState, settings: AdlSettings) -> jax.Array:
    """k [B] int32 = clip(floor(avg L_gen) + bonus * [avg L_acc >= avg L_gen], k_min, k_max)."""
    k = jnp.floor(state.avg_gen) + settings.bonus * (state.avg_acc >= state.avg_gen)
    return jnp.clip(k, settings.k_min, settings.k_max).astype(jnp.int32)


def update(
    state: AdlState, generated: jax.Array, accepted: jax.Array, active: jax.Array, settings: AdlSettings
) -> AdlState:
    """The averages after one verify step of the `active` [B] rows.

    Args:
      state: the averages before the step.
      generated: [B] L_gen, drafted tokens before the first EOS (<= k).
      accepted: [B] L_acc, drafts the target accepted.
      active: [B] bool, rows that drafted this step (others keep their averages).
      settings: rho.
    """
    rho = settings.rho
    avg_gen = rho * state.avg_gen + (1 - rho) * generated.astype(jnp.float32)
    avg_acc = rho * state.avg_acc + (1 - rho) * accepted.astype(jnp.float32)
    return AdlState(jnp.where(active, avg_gen, state.avg_gen), jnp.where(active, avg_acc, state.avg_acc))
