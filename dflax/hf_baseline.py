"""The peer baseline: HF transformers (PyTorch, CPU) `generate` on the same weights and token ids.

Run by `dflax bench --method hf` in a child process of its own, so that neither library's thread pools
slow the other down (XLA's CPU threads keep spinning after a JAX computation and starve PyTorch).
Usage: python -m dflax.hf_baseline REQUEST.json RESULT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class _FirstTokenClock:
    """An HF streamer that notes when the first generated token appears (the end of prefill)."""

    def __init__(self):
        self.calls = 0
        self.first_token_at = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt, call 2 the first sampled token
            self.first_token_at = time.perf_counter()

    def end(self):
        pass


def load_model(kind: str, path: str):
    """The target as a float32 transformers PyTorch model, in eval mode (kind "gguf" or "hf_dir", as
    `dflax.checkpoints.registry.resolve` names them)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def run(request: dict) -> list[dict]:
    """Generates every batch of the request; returns per-batch tokens and timings.

    Args:
      request: {"kind": "gguf" | "hf_dir", "path", "batches": [[ids, ...], ...], "max_new_tokens",
        "temperature", "eos_ids", "pad_id", "seed"}.
    """
    import torch

    model = load_model(request["kind"], request["path"])
    eos, pad, temperature = request["eos_ids"], request["pad_id"], request["temperature"]

    def generate(rows, budget, seed):
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        clock = _FirstTokenClock()
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=budget,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=None,
                top_k=None,
                eos_token_id=eos,
                pad_token_id=pad,
                streamer=clock,
            )
        t1 = time.perf_counter()
        new = []
        for row in out[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            new.append(row[:cut])
        first = clock.first_token_at or t1
        return {"tokens": new, "prefill_s": first - t0, "decode_s": t1 - first}

    # PyTorch on CPU is slow the first time it meets each new sequence length (measured here: 11.6 s
    # vs 1.6 s for the same 32 tokens), so, as dflax compiles every shape first, every batch runs once
    # untimed before the timed pass.
    for i, rows in enumerate(request["batches"]):
        generate(rows, request["max_new_tokens"], request["seed"] + i)
    return [
        generate(rows, request["max_new_tokens"], request["seed"] + i)
        for i, rows in enumerate(request["batches"])
    ]


def main() -> None:
    """Entry point: python -m dflax.hf_baseline REQUEST.json RESULT.json."""
    request = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(request)))


if __name__ == "__main__":
    main()
