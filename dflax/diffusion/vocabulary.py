"""Whether a diffusion drafter can draft for a target.

A drafter and its target share a tokenizer but not always a vocabulary width: checkpoints pad their
embedding tables differently (Dream-7B: 152,064 rows; Qwen2.5-0.5B: 151,936; both hold the same 151,665
tokens). The drafter reads every token the target commits, so each id the target can emit must be a row of
the drafter's table; ids only the drafter has (padding rows) never become drafts, because drafting reads
only the first `vocab_size` logits (`dflax.diffusion.refine.window_log_probs`).
"""

from __future__ import annotations


class VocabularyMismatchError(ValueError):
    """A drafter cannot read every token its target may commit."""


def check_vocabulary(
    drafter_vocab_size: int, target_vocab_size: int, target_tokens: int | None = None
) -> None:
    """Raises unless every token the target can emit is an id the drafter reads.

    Args:
      drafter_vocab_size: the drafter's logits width (`DiffusionLM.vocab_size`).
      target_vocab_size: the target's logits width.
      target_tokens: the target tokenizer's number of ids (added tokens included), when known; the target
        then emits only those ids, so a drafter narrower than the target's padded table still fits.

    Raises:
      VocabularyMismatchError: naming both sizes and the remedy.
    """
    needed = target_vocab_size if target_tokens is None else min(target_tokens, target_vocab_size)
    if needed > drafter_vocab_size:
        raise VocabularyMismatchError(
            f"the drafter's vocabulary has {drafter_vocab_size} ids but the target emits up to {needed} "
            f"(logits width {target_vocab_size}); a diffusion drafter must share the target's tokenizer "
            "(Dream drafts for Qwen2.5 targets; LLaDA has its own tokenizer)"
        )
