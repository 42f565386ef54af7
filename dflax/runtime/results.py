"""One prompt's output: text, token ids and stats."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from dflax.target import Target

if TYPE_CHECKING:
    pass


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
