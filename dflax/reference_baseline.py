"""The reference DFlash as a peer: `dflash.model.dflash_generate` (z-lab, PyPI `dflash`) on the same target
weights (transformers, PyTorch, CPU) and the same drafter in the official format.

Run in a child process of its own, as `dflax bench --method hf` runs HF's generate (XLA's CPU threads keep
spinning after a JAX computation and starve PyTorch). The reference times itself through a clock that
synchronizes CUDA; on a CPU that clock is replaced by `time.perf_counter`, nothing else of it is changed.
Its loop decodes one prompt at a time (batch 1): greedy at temperature 0 (accept while the drafts equal the
target's argmax), token-by-token rejection sampling otherwise.
Usage: python -m dflax.reference_baseline REQUEST.json RESULT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# Prompts decoded once, untimed, before the timed pass: PyTorch on a CPU is slow the first time it meets
# each shape, and the reference's decode shapes (a block of B, 1..B new context tokens) recur every prompt.
WARMUP_PROMPTS = 2


def run(request: dict) -> list[dict]:
    """Decodes every prompt of the request with the reference loop.

    Args:
      request: {"kind": "gguf" | "hf_dir", "path" (the target), "drafter" (an official-format drafter
        directory), "prompts": [ids, ...], "max_new_tokens", "temperature", "eos_ids", "seed"}.

    Returns:
      One dict per prompt: tokens (new tokens, cut after the first EOS), commits (tokens each step added,
      the reference's acceptance lengths), prefill_s, decode_s.
    """
    import dflash.model as reference
    import torch

    from dflax.hf_baseline import load_model

    reference._cuda_time = time.perf_counter  # its clock synchronizes CUDA; this is a CPU
    target = load_model(request["kind"], request["path"])
    drafter = reference.DFlashDraftModel.from_pretrained(request["drafter"], dtype=torch.float32).eval()
    eos = list(request["eos_ids"])

    def decode(ids: list[int], seed: int) -> dict:
        torch.manual_seed(seed)
        stats = reference.dflash_generate(
            drafter,
            target,
            torch.tensor([ids]),
            request["max_new_tokens"],
            eos,
            temperature=request["temperature"],
            return_stats=True,
        )
        new = stats.output_ids[0, len(ids) :].tolist()
        cut = next((j + 1 for j, t in enumerate(new) if t in eos), len(new))
        decode_s = stats.time_per_output_token * stats.num_output_tokens
        return {
            "tokens": new[:cut],
            "commits": [int(c) for c in stats.acceptance_lengths],
            "prefill_s": stats.time_to_first_token,
            "decode_s": decode_s,
        }

    prompts, seed = request["prompts"], request["seed"]
    for i, ids in enumerate(prompts[:WARMUP_PROMPTS]):
        decode(ids, seed + i)
    return [decode(ids, seed + i) for i, ids in enumerate(prompts)]


def main() -> None:
    """Entry point: python -m dflax.reference_baseline REQUEST.json RESULT.json."""
    request = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(request)))


if __name__ == "__main__":
    main()
