"""`dflax bench`: decode speed of methods on one prompt set, measured back to back in one run.

Every method sees the same token ids. Each compiled shape is warmed up before timing. Decode tokens/s
counts the tokens produced after the first one (which comes out of prefill) over decode time only;
prefill time is reported separately.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
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


def _run_hf(target: Target, prompt_ids, max_new_tokens, temperature, batch_size, seed, progress):
    """HF transformers (PyTorch, CPU) generate on the same weights, in a child process (see hf_baseline)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ImportError("--method hf needs PyTorch: pip install torch==2.13.0 accelerate (CPU wheel)")
    from dflax.checkpoints.registry import resolve

    kind, path = resolve(target.name)
    batches = _batches(list(range(len(prompt_ids))), batch_size)
    eos = list(target.eos_ids)
    request = {
        "kind": kind,
        "path": str(path),
        "batches": [[prompt_ids[i] for i in idx] for idx in batches],
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "eos_ids": eos,
        "pad_id": target.tokenizer.pad_id if target.tokenizer.pad_id is not None else eos[0],
        "seed": seed,
    }
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        subprocess.run(
            [sys.executable, "-m", "dflax.hf_baseline", str(req), str(res)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        outputs = json.loads(res.read_text())
    tokens, per_batch = [None] * len(prompt_ids), []
    for idx, out in zip(batches, outputs):
        for i, t in zip(idx, out["tokens"]):
            tokens[i] = t
        steps = max(len(t) for t in out["tokens"]) - 1
        per_batch.append(
            {
                "rows": len(idx),
                "prefill_s": out["prefill_s"],
                "decode_s": out["decode_s"],
                "decode_tokens": sum(len(t) - 1 for t in out["tokens"]),
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
