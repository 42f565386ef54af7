"""`dflax bench`: decode speed of methods on one prompt set, measured back to back in one run.

Every method sees the same token ids. Each compiled shape is warmed up before timing. Decode tokens/s
counts the tokens produced after the first one (which comes out of prefill) over decode time only;
prefill time is reported separately.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from dflax.generation import encode_prompt, fit_to_context, generate_ids
from dflax.prompts import load_prompts
from dflax.spec.sampling import SamplingParams
from dflax.target import Target, load_target

BENCH_METHODS = ("ar", "hf")


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _run_dflax(target: Target, prompt_ids, max_new_tokens, temperature, batch_size, seed, progress):
    sampling = SamplingParams.make(temperature)
    batches = _batches(list(range(len(prompt_ids))), batch_size)
    for idx in batches:  # compile every shape first
        generate_ids(
            target,
            [prompt_ids[i] for i in idx],
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            row_seeds=[seed + i for i in idx],
            batch_size=batch_size,
            warmup=True,
        )
    tokens, per_batch = [None] * len(prompt_ids), []
    for idx in batches:
        results = generate_ids(
            target,
            [prompt_ids[i] for i in idx],
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            row_seeds=[seed + i for i in idx],
            batch_size=batch_size,
        )
        for i, r in zip(idx, results):
            tokens[i] = r.tokens
        per_batch.append(
            {
                "rows": len(idx),
                "prefill_s": results[0].stats["prefill_s"],
                "decode_s": results[0].stats["decode_s"],
                "decode_tokens": sum(len(r.tokens) - 1 for r in results),
                "steps": sum(r.stats["steps"] for r in results),
                "committed": sum(r.stats["tau"] * r.stats["steps"] for r in results),
            }
        )
        progress(len(idx))
    return tokens, per_batch


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


def _run_hf(target: Target, prompt_ids, max_new_tokens, temperature, batch_size, seed, progress):
    """HF transformers (PyTorch, CPU) generate on the same weights: the peer baseline."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ImportError(
            "--method hf needs PyTorch: pip install torch==2.13.0 (CPU wheel) accelerate"
        ) from e
    from dflax.checkpoints.registry import resolve

    kind, path = resolve(target.name)
    if kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    eos = list(target.eos_ids)
    pad = target.tokenizer.pad_id if target.tokenizer.pad_id is not None else eos[0]

    def run(idx, budget):
        rows = [prompt_ids[i] for i in idx]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        clock = _FirstTokenClock()
        torch.manual_seed(seed + idx[0])
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
        return new, first - t0, t1 - first

    batches = _batches(list(range(len(prompt_ids))), batch_size)
    run(batches[0], 2)  # warm-up
    tokens, per_batch = [None] * len(prompt_ids), []
    for idx in batches:
        new, prefill_s, decode_s = run(idx, max_new_tokens)
        for i, t in zip(idx, new):
            tokens[i] = t
        steps = max(len(t) for t in new) - 1
        per_batch.append(
            {
                "rows": len(idx),
                "prefill_s": prefill_s,
                "decode_s": decode_s,
                "decode_tokens": sum(len(t) - 1 for t in new),
                "steps": steps * len(idx),
                "committed": steps * len(idx),
            }
        )
        progress(len(idx))
    return tokens, per_batch


def _summary(method: str, per_batch: list[dict[str, Any]]) -> dict[str, Any]:
    decode_s = sum(b["decode_s"] for b in per_batch)
    decode_tokens = sum(b["decode_tokens"] for b in per_batch)
    steps = sum(b["steps"] for b in per_batch)
    return {
        "method": method,
        "new_tokens": decode_tokens + sum(b["rows"] for b in per_batch),
        "decode_tokens": decode_tokens,
        "tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "median_batch_tokens_per_s": statistics.median(
            b["decode_tokens"] / b["decode_s"] for b in per_batch if b["decode_s"] > 0
        ),
        "decode_s": decode_s,
        "prefill_s": sum(b["prefill_s"] for b in per_batch),
        "median_prefill_s": statistics.median(b["prefill_s"] for b in per_batch),
        "tau": sum(b["committed"] for b in per_batch) / steps if steps else 1.0,
    }


def run_bench(
    *,
    prompts: str,
    target: str,
    methods: list[str],
    limit: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    console=None,
) -> dict[str, Any]:
    """Benchmarks methods back to back on the same prompts and target.

    Args:
      prompts: "humaneval", "mtbench" or a JSONL file.
      target: target name or path.
      methods: subset of BENCH_METHODS; "ar" is dflax plain decoding and the reference for speedups.
      limit: first N prompts.
      max_new_tokens: budget per prompt.
      temperature: 0 = greedy.
      batch_size: prompts per batch.
      seed: sampling seed.
      console: optional rich console for progress.

    Returns:
      {"target", "prompts", "n_prompts", "batch_size", "max_new_tokens", "temperature", "results": [...]},
      one result per method with tokens_per_s (decode only), prefill_s, tau, and, when "ar" ran too,
      ar_tokens_per_s, speedup and lossless_match (fraction of prompts token-identical to ar at T=0).
    """
    from rich.progress import Progress

    records, bad = load_prompts(prompts)
    if bad:
        raise ValueError(f"{prompts}: malformed lines: " + "; ".join(map(str, bad)))
    records = records[:limit]
    loaded = load_target(target)
    context = loaded.config.max_position_embeddings
    prompt_ids = [
        fit_to_context(encode_prompt(loaded, r.prompt), max_new_tokens, context, False, str(r.id))
        for r in records
    ]
    runners = {"ar": _run_dflax, "hf": _run_hf}
    outputs, results = {}, []
    with Progress(console=console, disable=console is None) as progress:
        for method in methods:
            task = progress.add_task(method, total=len(prompt_ids))
            tokens, per_batch = runners[method](
                loaded,
                prompt_ids,
                max_new_tokens,
                temperature,
                batch_size,
                seed,
                lambda k, task=task: progress.advance(task, k),
            )
            outputs[method] = tokens
            results.append(_summary(method, per_batch))
    if "ar" in outputs:
        ar = next(r for r in results if r["method"] == "ar")
        for r in results:
            r["ar_tokens_per_s"] = ar["tokens_per_s"]
            r["speedup"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else None
            if temperature == 0:
                same = [a == b for a, b in zip(outputs["ar"], outputs[r["method"]])]
                r["lossless_match"] = float(np.mean(same))
    return {
        "target": target,
        "prompts": prompts,
        "n_prompts": len(prompt_ids),
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "results": results,
    }
