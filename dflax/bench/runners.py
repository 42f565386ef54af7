"""How `dflax bench` runs one method on the prompts: dflax static or continuous batches, auto's
choice, HF transformers in a child process, refill and DiffuSpec variants."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from dflax.decoding.sampling import SamplingParams
from dflax.decoding.shared_prefix import share_groups
from dflax.planning.auto import AutoSettings
from dflax.planning.auto import run_auto as auto_run
from dflax.runtime.programs import can_share_prefix
from dflax.runtime.static_batches import generate_ids
from dflax.target import Target


def in_batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def prefix_kv_bytes(target: Target, prompt_ids, shared_prefix: str) -> int:
    """Bytes of target KV cache that the batch's common prompt prefixes (`share_groups`) take: stored
    once per group with shared_prefix="auto", once per row with "none" (layers x 2 x K x H x itemsize
    per token)."""
    config = target.config
    itemsize = np.dtype(target.cache_dtype).itemsize
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize
    once = shared_prefix == "auto" and can_share_prefix(target)
    return per_token * sum((1 if once else len(g.rows)) * g.length for g in share_groups(prompt_ids))


def tallies(results) -> dict[str, Any]:
    """What a group of results (a batch, or a continuous run) adds up to: decoded tokens (after each first
    one), verify steps, tokens committed and the accepted-length histogram."""
    return {
        "rows": len(results),
        "decode_tokens": sum(len(r.tokens) - 1 for r in results),
        "steps": sum(r.stats["steps"] for r in results),
        "committed": sum(r.stats["tau"] * r.stats["steps"] for r in results),
        "accept_hist": np.sum([r.stats["accept_hist"] for r in results], axis=0).tolist(),
    }


def run_dflax(
    target: Target,
    prompt_ids,
    max_new_tokens,
    temperature,
    batch_size,
    seed,
    progress,
    drafter=None,
    shared_prefix="none",
):
    sampling = SamplingParams.make(temperature)
    batches = in_batches(list(range(len(prompt_ids))), batch_size)

    def run(idx, warmup=False):
        return generate_ids(
            target,
            [prompt_ids[i] for i in idx],
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            row_seeds=[seed + i for i in idx],
            batch_size=batch_size,
            drafter=drafter,
            warmup=warmup,
            shared_prefix=shared_prefix,
        )

    for idx in batches:  # compile every shape first
        run(idx, warmup=True)
    tokens, per_batch = [None] * len(prompt_ids), []
    for idx in batches:
        results = run(idx)
        for i, r in zip(idx, results):
            tokens[i] = r.tokens
        per_batch.append(
            {
                **tallies(results),
                "prompt_tokens": sum(len(prompt_ids[i]) for i in idx),
                "prefill_s": results[0].stats["prefill_s"],
                "decode_s": results[0].stats["decode_s"],
                "loop_steps": max(r.stats["steps"] for r in results),  # decode-loop iterations
                "kv_cache_bytes": results[0].stats["kv_cache_bytes"],
                "prefix_kv_bytes": prefix_kv_bytes(target, [prompt_ids[i] for i in idx], shared_prefix),
            }
        )
        progress(len(idx))
    return tokens, per_batch


def run_continuous(
    target: Target,
    prompt_ids,
    max_new_tokens,
    temperature,
    batch_size,
    seed,
    progress,
    drafter=None,
    refill_every=16,
):
    """Continuous batching over the whole prompt set: every `refill_every` decode steps, finished rows
    take the next prompts (dflax.runtime.continuous). Refills prefill a varying number of rows, so the
    warm-up is one untimed run of the same prompts: it compiles every shape the timed run meets."""
    from dflax.runtime.continuous import generate_continuous

    def run(timing=None, on_result=None):
        return generate_continuous(
            target,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams.make(temperature),
            row_seeds=[seed + i for i in range(len(prompt_ids))],
            batch_size=batch_size,
            refill_every=refill_every,
            drafter=drafter,
            on_result=on_result,
            timing=timing,
        )

    run()
    timing = {}
    results = run(timing, on_result=lambda i, r: progress(1))
    per_batch = [
        {
            **tallies(results),
            "prompt_tokens": sum(len(p) for p in prompt_ids),
            "prefill_s": timing["prefill_s"],
            "decode_s": timing["decode_s"],
            "loop_steps": timing["loop_steps"],
            "refills": timing["refills"],
        }
    ]
    return [r.tokens for r in results], per_batch


def run_auto(
    target: Target,
    prompt_ids,
    max_new_tokens,
    temperature,
    batch_size,
    seed,
    progress,
    drafter,
    context,
    trees,
    shared_prefix="none",
):
    """DFlash or DART at the block size (or, with `trees`, the tree budget) the cost model picks for this
    batch size, or plain decoding when nothing pays; after the first prompts chosen again with the
    acceptance those prompts showed (`dflax.planning.auto`). Bench decodes static batches."""
    settings = AutoSettings.for_run(
        [len(p) for p in prompt_ids], batch_size, max_new_tokens,
        trees=trees, static=True, sampling=SamplingParams.make(temperature),  # as `run_dflax` decodes
    )  # fmt: skip
    settings = dataclasses.replace(settings, context=context)
    tokens, per_batch = [], []

    def run(start, end, chosen):
        done, batches = run_dflax(
            target, prompt_ids[start:end], max_new_tokens=max_new_tokens, temperature=temperature,
            batch_size=batch_size, seed=seed + start, progress=progress, drafter=chosen,
            shared_prefix=shared_prefix,
        )  # fmt: skip
        tokens.extend(done)
        per_batch.extend(batches)
        return np.sum([b["accept_hist"] for b in batches], axis=0)

    decided = auto_run(target, drafter, settings, len(prompt_ids), run)
    choice = decided.final
    width = max(len(b["accept_hist"]) for b in per_batch)
    for b in per_batch:
        b["accept_hist"] = list(b["accept_hist"]) + [0] * (width - len(b["accept_hist"]))
        b["block_size"] = choice.block_size
        b["tree_budget"] = choice.tree_budget
        b["auto_predicted"] = {k: {"tau": t, "speedup": x} for k, (t, x) in choice.predicted.items()}
        b["auto_predicted_trees"] = {
            n: {"tau": t, "speedup": x} for n, (t, x) in choice.predicted_trees.items()
        }
        if decided.probe:
            b["auto_probe"] = {
                "prompts": decided.probe,
                "block_size": decided.first.block_size,
                "tree_budget": decided.first.tree_budget,
                "acceptance_scale": decided.acceptance_scale,
            }
    return tokens, per_batch


def run_hf(target: Target, prompt_ids, max_new_tokens, temperature, batch_size, seed, progress):
    """HF transformers (PyTorch, CPU) generate on the same weights, in a child process (see hf_baseline)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ImportError("--method hf needs PyTorch: pip install torch==2.13.0 accelerate (CPU wheel)")
    from dflax.checkpoints.registry import resolve

    kind, path = resolve(target.name)
    batches = in_batches(list(range(len(prompt_ids))), batch_size)
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
                "prompt_tokens": sum(len(prompt_ids[i]) for i in idx),
                "prefill_s": out["prefill_s"],
                "decode_s": out["decode_s"],
                "decode_tokens": sum(len(t) - 1 for t in out["tokens"]),
                "steps": steps * len(idx),
                "committed": steps * len(idx),
            }
        )
        progress(len(idx))
    return tokens, per_batch


def with_refills(runners: dict, settings: dict, refill_every: list[int], mesh: str | None) -> dict:
    """The runners once per refill setting: 0 keeps the static-batch runner, k > 0 adds its continuous
    batching twin "<name>-refill<k>" (dflax's fixed-block-size methods only)."""
    if any(k < 0 for k in refill_every):
        raise ValueError(f"--refill-every {refill_every}: give integers >= 0 (0 = static batches)")
    out = {}
    for name, runner in runners.items():
        settings[name]["refill_every"] = 0
        if 0 in refill_every:
            out[name] = runner
        for k in (k for k in refill_every if k > 0):
            if mesh:
                raise ValueError("--refill-every does not run on a mesh yet; leave it out with --mesh")
            if runner is not run_dflax and getattr(runner, "func", None) is not run_dflax:
                raise ValueError(
                    f"--refill-every applies to dflax's methods at fixed block sizes, not {name!r}: "
                    "give --block-size N for dflash, or leave out hf and official"
                )
            keywords = runner.keywords if isinstance(runner, functools.partial) else {}
            if keywords.get("shared_prefix", "none") != "none":
                raise ValueError("--refill-every and --shared-prefix auto do not combine yet; run them apart")
            drafter = keywords.get("drafter")
            out[f"{name}-refill{k}"] = functools.partial(run_continuous, drafter=drafter, refill_every=k)
            settings[f"{name}-refill{k}"] = {**settings[name], "refill_every": k}
    return out


def diffuspec_runs(drafter, target: Target, windows, refine_steps: int, cps_modes):
    """(name, DiffuSpec drafter, settings) per --window setting and CPS mode, the diffusion LM loaded once."""
    from dflax.drafters.diffuspec_loader import WindowSetting, load_diffuspec

    parsed = [WindowSetting.parse(w) for w in windows or ["auto"]]
    base = load_diffuspec(drafter, target, parsed[0], refine_steps, True)
    runs = []
    for setting in parsed:
        for cps in cps_modes or [True]:
            name = "diffuspec" + (f"-w{setting.label}" if len(parsed) > 1 else "") + ("" if cps else "-nocps")
            bounds = setting.adl_bounds
            drafter_at = base.with_settings(setting.window, bounds, cps)
            info = {"block_size": None, "tree_budget": 0, "window": setting.label, "cps": cps}
            runs.append((name, drafter_at, {**info, "refine_steps": refine_steps}))
    return runs
