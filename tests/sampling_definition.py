"""The target distribution that sampling settings define, written from the definition in float64 numpy.

The tests' oracle for `dflax.decoding.sampling.target_log_probs`: exact distributions built with this, not
with the code under test, so a wrong temperature (logits * T), a filter applied before the temperature
or a wrong nucleus boundary shows as a mismatch. The order is the one HF transformers and llama.cpp use:
temperature, then top-k, then top-p over the tempered top-k distribution.
"""

from __future__ import annotations

import numpy as np


def kept_set(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """[V] bool: the top-k tokens of `scaled`, then the smallest most-likely prefix of them whose mass
    (renormalised over the top-k) reaches top_p; tokens tied with the last kept one are kept too."""
    order = np.argsort(-scaled, kind="stable")
    in_k = order[: top_k if top_k > 0 else scaled.size]
    probs = np.exp(scaled[in_k] - scaled[in_k].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    n_keep = max(int(np.sum(mass_before < top_p)), 1)
    return scaled >= scaled[in_k[n_keep - 1]]


def target_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The sampling distribution over the last axis of logits [..., V], float64.

    Temperature 0 is a one-hot on the first argmax; otherwise softmax(logits / T) restricted to
    `kept_set(logits / T, top_k, top_p)` and renormalised.
    """
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return np.eye(logits.shape[-1])[logits.argmax(axis=-1)]
    scaled = logits / temperature
    kept = np.apply_along_axis(kept_set, -1, scaled, top_k, top_p)
    probs = np.where(kept, np.exp(scaled - scaled.max(axis=-1, keepdims=True)), 0.0)
    return probs / probs.sum(axis=-1, keepdims=True)
