"""The running totals of a `dflax generate` run."""

from __future__ import annotations

import time


class RunTotals:
    """Running totals of a generate run: the progress bar's tokens/s and tau, and the final summary line."""

    def __init__(self, speculative: bool):
        self.speculative = speculative
        self.prompts = self.prompt_tokens = self.new_tokens = self.steps = 0
        self.committed = 0.0
        self.finish: dict[str, int] = {}
        self.t0 = time.perf_counter()

    def add(self, stats: dict) -> None:
        """Counts one finished prompt."""
        self.prompts += 1
        self.prompt_tokens += stats["prompt_tokens"]
        self.new_tokens += stats["new_tokens"]
        self.steps += stats["steps"]
        self.committed += stats["tau"] * stats["steps"]
        self.finish[stats["finish_reason"]] = self.finish.get(stats["finish_reason"], 0) + 1

    def rate(self) -> str:
        """New tokens/s since the start (and tau for speculative decoding)."""
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        tau = f"  tau {self.committed / self.steps:.2f}" if self.speculative and self.steps else ""
        return f"{self.new_tokens / elapsed:.1f} tok/s{tau}"

    def summary(self) -> str:
        """The final line: prompts, tokens, time, rate, tau, how the prompts ended."""
        elapsed = time.perf_counter() - self.t0
        tau = f", tau {self.committed / self.steps:.2f}" if self.speculative and self.steps else ""
        ends = ", ".join(f"{n} {reason}" for reason, n in sorted(self.finish.items()))
        return (
            f"{self.prompts} prompts ({self.prompt_tokens} prompt tokens), {self.new_tokens} new tokens in "
            f"{elapsed:.1f}s ({self.new_tokens / max(elapsed, 1e-9):.1f} tokens/s, compilation included{tau})"
            + (f"; finished by {ends}" if ends else "")
        )
