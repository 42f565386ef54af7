"""One mixed-length batch through a diffusion LM's `observe` + `window_logits`, and what an unpadded
reference forward over each row's [context | last_token | window] says the window's logits are."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from dflax.diffusion.bidirectional import DEFAULT_CONTEXT

BATCH_LENGTHS = (0, 5, 300)  # committed tokens per row: none, fewer than the context, more than it
SLOTS = 320  # history slots S
# C: the default, so that one forward (C + 1 + K tokens) spans two of the CPU attention's query blocks and a
# causal shortcut there would show.
CONTEXT = DEFAULT_CONTEXT
WINDOW = 4  # K
FIRST_CALL = 6  # tokens observed in the first of two observe calls (a prompt), the rest in the second


def run_window_case(drafter, params, token_range: int, seed: int = 0):
    """Observes random histories in two calls, then takes the window logits of a half-masked window.

    Returns:
      (logits [B, K, V] as numpy, the rows: one (context tokens, last token, window) per row).
    """
    rng = np.random.default_rng(seed)
    b = len(BATCH_LENGTHS)
    length = np.array(BATCH_LENGTHS, np.int32)
    history = rng.integers(0, token_range, (b, SLOTS)).astype(np.int32)
    state = drafter.init_state(b, SLOTS)
    observe = jax.jit(drafter.observe)
    first = np.minimum(length, FIRST_CALL)
    positions = np.broadcast_to(np.arange(SLOTS, dtype=np.int32), (b, SLOTS))
    state = observe(params, state, history[:, :FIRST_CALL], positions[:, :FIRST_CALL], first)
    state = observe(params, state, history[:, FIRST_CALL:], positions[:, FIRST_CALL:], length - first)
    held = np.asarray(state.tokens)
    for row, n in enumerate(length):  # committed tokens kept, padding entries dropped
        np.testing.assert_array_equal(held[row, :n], history[row, :n])
        np.testing.assert_array_equal(held[row, n:], 0)
    last = rng.integers(0, token_range, (b,)).astype(np.int32)
    window = rng.integers(0, token_range, (b, WINDOW)).astype(np.int32)
    window[:, ::2] = drafter.mask_token_id
    logits = jax.jit(drafter.window_logits)(params, state, last, length, window)
    rows = [(history[r, max(0, n - drafter.context) : n], last[r], window[r]) for r, n in enumerate(length)]
    return np.asarray(logits), rows


def expected_window_logits(rows, reference: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """[B, K, V]: the reference's logits at each row's window slots, the row run alone and unpadded."""
    out = []
    for context, last, window in rows:
        sequence = np.concatenate([context, [last], window]).astype(np.int64)
        start = len(context) + 1
        out.append(reference(sequence)[start : start + len(window)])
    return np.stack(out)
