"""`dflax bench`: decode speed of methods on one prompt set, measured back to back in one run.

Every method sees the same token ids. Each compiled shape is warmed up before timing. Decode tokens/s
counts the tokens produced after the first one (which comes out of prefill) over decode time only;
prefill time is reported separately.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflax import projection
from dflax.cost_curve import COST_CURVE_SIZES, measure_cost_curve
from dflax.decoding.sampling import SamplingParams
from dflax.decoding.shared_prefix import share_groups
from dflax.divergence import first_differences
from dflax.drafters.checkpoint import load_drafter_checkpoint
from dflax.drafters.dflash import DRAFT_SAMPLING_MODES
from dflax.generation import (
    cache_slots,
    can_share_prefix,
    encode_prompt,
    fit_to_context,
    generate_ids,
    prompt_bucket,
)
from dflax.prompts import load_prompts, with_system_prompt
from dflax.roofline import machine_facts, measure_roofline, step_floor_s
from dflax.target import Target, load_target

BENCH_METHODS = ("ar", "dflash", "dart", "lookup", "diffuspec", "hf", "official")
AUTO = "auto"  # a block size chosen by the cost model (dflax.decoding.block_size)


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _prefix_kv_bytes(target: Target, prompt_ids, shared_prefix: str) -> int:
    """Bytes of target KV cache that the batch's common prompt prefixes (`share_groups`) take: stored
    once per group with shared_prefix="auto", once per row with "none" (layers x 2 x K x H x itemsize
    per token)."""
    config = target.config
    itemsize = np.dtype(target.cache_dtype).itemsize
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize
    once = shared_prefix == "auto" and can_share_prefix(target)
    return per_token * sum((1 if once else len(g.rows)) * g.length for g in share_groups(prompt_ids))


def _tallies(results) -> dict[str, Any]:
    """What a group of results (a batch, or a continuous run) adds up to: decoded tokens (after each first
    one), verify steps, tokens committed and the accepted-length histogram."""
    return {
        "rows": len(results),
        "decode_tokens": sum(len(r.tokens) - 1 for r in results),
        "steps": sum(r.stats["steps"] for r in results),
        "committed": sum(r.stats["tau"] * r.stats["steps"] for r in results),
        "accept_hist": np.sum([r.stats["accept_hist"] for r in results], axis=0).tolist(),
    }


def _run_dflax(
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
    batches = _batches(list(range(len(prompt_ids))), batch_size)

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
                **_tallies(results),
                "prompt_tokens": sum(len(prompt_ids[i]) for i in idx),
                "prefill_s": results[0].stats["prefill_s"],
                "decode_s": results[0].stats["decode_s"],
                "loop_steps": max(r.stats["steps"] for r in results),  # decode-loop iterations
                "kv_cache_bytes": results[0].stats["kv_cache_bytes"],
                "prefix_kv_bytes": _prefix_kv_bytes(target, [prompt_ids[i] for i in idx], shared_prefix),
            }
        )
        progress(len(idx))
    return tokens, per_batch


def _run_continuous(
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
    take the next prompts (dflax.continuous_batching). Refills prefill a varying number of rows, so the
    warm-up is one untimed run of the same prompts: it compiles every shape the timed run meets."""
    from dflax.continuous_batching import generate_continuous

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
            **_tallies(results),
            "prompt_tokens": sum(len(p) for p in prompt_ids),
            "prefill_s": timing["prefill_s"],
            "decode_s": timing["decode_s"],
            "loop_steps": timing["loop_steps"],
            "refills": timing["refills"],
        }
    ]
    return [r.tokens for r in results], per_batch


def _run_auto(
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
    batch size, or plain decoding when nothing pays; after the first prompts (`probe_size`), chosen again
    with the acceptance those prompts showed (`scaled_to_probe`)."""
    from dflax.cost_curve import auto_block_size, probe_size, scaled_to_probe

    rows = min(batch_size, len(prompt_ids))
    median = sorted(len(p) for p in prompt_ids)[len(prompt_ids) // 2]
    # Bench decodes static batches: with several rows, each batch waits for its slowest row.
    choose = functools.partial(
        auto_block_size,
        target,
        rows=rows,
        context=context,
        trees=trees,
        slots=cache_slots(prompt_bucket(median), max_new_tokens, None),
        static_tokens=max_new_tokens,
        sampling=SamplingParams.make(temperature),  # as `_run_dflax` decodes
    )
    run = functools.partial(
        _run_dflax, target, max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size,
        progress=progress, shared_prefix=shared_prefix,
    )  # fmt: skip
    chosen, choice = choose(drafter)
    probe = probe_size(rows, len(prompt_ids))
    probed = {}
    if chosen is None or not probe:  # plain decoding measures no acceptance
        tokens, per_batch = run(prompt_ids, seed=seed, drafter=chosen)
    else:
        tokens, per_batch = run(prompt_ids[:probe], seed=seed, drafter=chosen)
        hist = np.sum([b["accept_hist"] for b in per_batch], axis=0)
        measured, scale = scaled_to_probe(drafter, hist, choice.block_size, choice.tree_budget)
        probed = {
            "prompts": probe,
            "block_size": choice.block_size,
            "tree_budget": choice.tree_budget,
            "acceptance_scale": scale,
        }
        chosen, choice = choose(measured)
        rest, rest_batches = run(prompt_ids[probe:], seed=seed + probe, drafter=chosen)
        tokens, per_batch = tokens + rest, per_batch + rest_batches
    width = max(len(b["accept_hist"]) for b in per_batch)
    for b in per_batch:
        b["accept_hist"] = list(b["accept_hist"]) + [0] * (width - len(b["accept_hist"]))
        b["block_size"] = choice.block_size
        b["tree_budget"] = choice.tree_budget
        b["auto_predicted"] = {k: {"tau": t, "speedup": x} for k, (t, x) in choice.predicted.items()}
        b["auto_predicted_trees"] = {
            n: {"tau": t, "speedup": x} for n, (t, x) in choice.predicted_trees.items()
        }
        if probed:
            b["auto_probe"] = probed
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


def _summary(method: str, batch_size: int, per_batch: list[dict[str, Any]]) -> dict[str, Any]:
    decode_s = sum(b["decode_s"] for b in per_batch)
    decode_tokens = sum(b["decode_tokens"] for b in per_batch)
    steps = sum(b["steps"] for b in per_batch)
    loop_steps = sum(b.get("loop_steps", 0) for b in per_batch)
    return {
        "method": method,
        "batch_size": batch_size,
        "new_tokens": decode_tokens + sum(b["rows"] for b in per_batch),
        "decode_tokens": decode_tokens,
        "tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "median_batch_tokens_per_s": statistics.median(
            b["decode_tokens"] / b["decode_s"] for b in per_batch if b["decode_s"] > 0
        ),
        "decode_s": decode_s,
        "prefill_s": sum(b["prefill_s"] for b in per_batch),
        "wall_tokens_per_s": (decode_tokens + sum(b["rows"] for b in per_batch))
        / (decode_s + sum(b["prefill_s"] for b in per_batch)),
        "median_prefill_s": statistics.median(b["prefill_s"] for b in per_batch),
        "prefill_tokens_per_s": sum(b["prompt_tokens"] for b in per_batch)
        / sum(b["prefill_s"] for b in per_batch),
        "step_s": decode_s / loop_steps if loop_steps else None,  # one decode-loop iteration (dflax)
        "tau": sum(b["committed"] for b in per_batch) / steps if steps else 1.0,
        "accept_hist": np.sum([b["accept_hist"] for b in per_batch], axis=0).tolist()
        if "accept_hist" in per_batch[0]
        else None,
        **{
            k: per_batch[0][k]
            for k in (
                "block_size",
                "tree_budget",
                "auto_predicted",
                "auto_predicted_trees",
                "auto_probe",
                "refills",
            )
            if k in per_batch[0]
        },
        **{
            k: sum(b[k] for b in per_batch)  # summed over batches
            for k in ("kv_cache_bytes", "prefix_kv_bytes")
            if k in per_batch[0]
        },
    }


def _median_round(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's result over rounds: the round of median decode tokens/s (the lower one of the middle
    two for an even count), with every round's tokens/s in run order under `round_tokens_per_s`."""
    if len(summaries) == 1:
        return summaries[0]
    ranked = sorted(summaries, key=lambda s: s["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "round_tokens_per_s": [s["tokens_per_s"] for s in summaries]}


def _weights_read(params) -> int:
    """Parameters one forward reads: every leaf, less an embedding that is only gathered (untied head)."""
    sizes = {
        jax.tree_util.keystr(p): leaf.size for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    if any("lm_head" in name for name in sizes):
        return sum(v for name, v in sizes.items() if "embed_tokens" not in name)
    return sum(sizes.values())


def _add_projection(results: list[dict], target: Target, drafter, n_prompts: int, dart=None) -> None:
    """Adds each speculative result's projected speedup on accelerators (see dflax.projection): a step
    verifies the block (or the tree's nodes and root) and runs the DFlash or DART drafter (lookup runs
    none)."""
    target_params = _weights_read(target.params)
    drafter_params = 0
    if drafter is not None:
        vocab = drafter.proposer.draft_vocab
        head_rows = len(vocab) if vocab is not None else target.config.vocab_size
        drafter_params = _weights_read(drafter.params) + head_rows * target.config.hidden_size
    dart_params = _weights_read(dart.params.drafter) if dart is not None else 0  # its own LM head included
    for r in results:
        if r.get("block_size") and r["method"] != "official":  # dflax's own steps only
            rows = min(r["batch_size"], n_prompts)
            verified = r["tree_budget"] + 1 if r.get("tree_budget") else r["block_size"]
            read = {"dflash": drafter_params, "dart": dart_params}.get(r["method"].split("-")[0], 0)
            r["projected_speedup"] = {
                key: projection.projected_speedup(chip, target_params, read, r["tau"], verified, rows)
                for key, chip in projection.ACCELERATORS.items()
            }


def _with_refills(runners: dict, settings: dict, refill_every: list[int], mesh: str | None) -> dict:
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
            if runner is not _run_dflax and getattr(runner, "func", None) is not _run_dflax:
                raise ValueError(
                    f"--refill-every applies to dflax's methods at fixed block sizes, not {name!r}: "
                    "give --block-size N for dflash, or leave out hf and official"
                )
            keywords = runner.keywords if isinstance(runner, functools.partial) else {}
            if keywords.get("shared_prefix", "none") != "none":
                raise ValueError("--refill-every and --shared-prefix auto do not combine yet; run them apart")
            drafter = keywords.get("drafter")
            out[f"{name}-refill{k}"] = functools.partial(_run_continuous, drafter=drafter, refill_every=k)
            settings[f"{name}-refill{k}"] = {**settings[name], "refill_every": k}
    return out


def _diffuspec_runs(drafter, target: Target, windows, refine_steps: int, cps_modes):
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


def run_bench(
    *,
    prompts: str,
    target: str,
    methods: list[str],
    limit: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int | list[int],
    seed: int,
    drafter: str | None = None,
    block_sizes: list[int | str] | None = None,
    tree_budgets: list[int] | None = None,
    draft_sampling: str = "auto",
    cost_curve: bool = False,
    cost_curve_sizes: tuple[int, ...] = COST_CURVE_SIZES,
    console=None,
    mesh: str | None = None,
    dtype: str | None = None,
    refill_every: list[int] | None = None,
    shared_prefix: list[str] | None = None,
    system_prompt: str | None = None,
    diffuspec_windows: list[str] | None = None,
    refine_steps: int = 1,
    cps_modes: list[bool] | None = None,
    lookup_min_match: int | None = None,
    rounds_per_method: int = 1,
) -> dict[str, Any]:
    """Benchmarks methods back to back on the same prompts and target.

    Args:
      prompts: "humaneval", "mtbench" or a JSONL file.
      target: target name or path.
      methods: subset of BENCH_METHODS; "ar" is dflax plain decoding and the reference for speedups.
        With several block sizes or tree budgets, "dflash", "dart" and "lookup" run once per size and
        budget, reported as e.g. "dflash-b{B}", "lookup-t{N}", "dart-t{N}", "dflash-b{B}-t{N}".
      limit: first N prompts.
      max_new_tokens: budget per prompt.
      temperature: 0 = greedy.
      batch_size: prompts per batch, or several: every method runs at each (results carry their
        batch_size; speedups and lossless_match compare with ar at the same batch size).
      seed: sampling seed.
      drafter: drafter path, "untrained", or None for the drafter shipped for the target; "dart" needs a
        DART directory or "untrained" here (dflash then uses the shipped drafter unless this is a DFlash
        directory).
      block_sizes: block sizes to run; "auto" picks DFlash's and DART's chain or tree per batch size from
        the cost model, or plain decoding when none pays (its result's block_size is None). Default:
        "auto" for a drafter with measured acceptance (TRAINING.json: the shipped one, any that `dflax
        train` exported) without tree budgets, else its trained block size; lookup: 8.
      tree_budgets: tree budgets to run for dflash, dart and lookup (0 = a chain; without them dflash and
        lookup decode chains, dart without measured acceptance DART's published 60 nodes).
      draft_sampling: "greedy" (delta rule), "sample" (block verification) or "auto" (greedy at temperature 0
        and for trees, else sample, a chain beside trees included; see `DraftSampling.for_target`); each
        dflash result with a fixed block size reports its own as draft_sampling.
      cost_curve: also time one verify forward for n = 1, 2, 4, ..., 32 tokens and one draft forward.
      cost_curve_sizes: the n of the cost curve (1 included; fewer sizes compile fewer forwards).
      console: optional rich console for progress.
      mesh: "data=D,model=M" to run dflax's methods sharded over that device mesh (see dflax.sharding).
      dtype: the target's dtype for dflax's methods ("float32", "bfloat16"); None = the platform's default.
      refill_every: run dflax's methods once per value: 0 in static batches (the default), k > 0 with
        continuous batching, finished rows refilled every k decode steps (reported as e.g. "ar-refill16";
        its speedup and lossless_match compare with the static "ar").
      shared_prefix: modes to run dflax's methods in ("none", "auto"; default ["none"]); with "auto" a
        method runs with shared prefixes too, reported as "{method}-shared" (compared with ar as usual).
      system_prompt: a system message put in front of every prompt (each becomes a chat).
      diffuspec_windows: "diffuspec" runs once per --window setting ("auto", "MIN:MAX" or "K"; default
        auto) and CPS mode (`cps_modes`, default [True]), with `refine_steps` forwards per draft; reported as
        "diffuspec", "-w{setting}" added with several windows, "-nocps" without CPS. `drafter` is then the
        diffusion LM directory (dflash uses the shipped drafter unless `drafter` is a DFlash directory).
      lookup_min_match: lookup verifies drafts only in steps where some row's last `min_match` tokens
        occurred before (0 = always); None = `DEFAULT_MIN_MATCH`. Lookup results record it as min_match.
      rounds_per_method: run every method this many times, round by round (ar, dflash, ar, dflash, ...),
        so that a slow drift of the machine's speed reaches every method alike; a result is then its round
        of median tokens/s (see `_median_round`), and outputs and lossless_match are the first round's.

    Returns:
      {"target", "prompts", "n_prompts", "batch_sizes", "max_new_tokens", "temperature", "machine" (CPU model
      and flags, devices: `dflax.roofline.machine_facts`), "roofline", "results": [...]}, one result per
      method and batch size with tokens_per_s (decode only), prefill_s, prefill_tokens_per_s, tau, accept_hist
      (steps by tokens committed = accepted depth + 1), block_size and tree_budget (None for ar and hf),
      step_s and step_vs_floor (one decode-loop iteration against this machine's floor for that many rows, see
      dflax.roofline), and, when "ar" ran too, ar_tokens_per_s, speedup and, at T=0, lossless_match (fraction
      of prompts token-identical to ar) and first_differences (where each other output leaves ar's and the
      target's logits there, see `dflax.divergence.first_differences`: near-ties show as gaps of a few
      hundredths).
      dflax's results add kv_cache_bytes (the allocated target KV cache, measured from the arrays) and
      prefix_kv_bytes (the common prompt prefixes' part of it), summed over batches. With
      rounds_per_method > 1 every result adds round_tokens_per_s (each round's, in run order) and, beside
      ar, round_speedups (round i over ar's round i).
    """
    if rounds_per_method < 1:
        raise ValueError(f"rounds per method must be >= 1, got {rounds_per_method}")
    shared_prefix = shared_prefix or ["none"]
    if any(m not in ("none", "auto") for m in shared_prefix):
        raise ValueError(f"shared_prefix modes are none and auto, got {shared_prefix}")
    from rich.progress import Progress

    if draft_sampling not in DRAFT_SAMPLING_MODES:
        raise ValueError(f"draft sampling {draft_sampling!r} unknown; use auto, greedy or sample")
    if tree_budgets and not {"dflash", "dart", "lookup"} & set(methods):
        raise ValueError("--tree-budget applies to --method dflash, dart and lookup; add one of them")
    records, bad = load_prompts(prompts)
    if bad:
        raise ValueError(f"{prompts}: malformed lines: " + "; ".join(map(str, bad)))
    records = records[:limit]
    if system_prompt is not None:
        records = with_system_prompt(records, system_prompt)
    loaded = load_target(target, dtype=dtype, mesh=mesh)
    context = loaded.config.max_position_embeddings
    prompt_ids = [
        fit_to_context(encode_prompt(loaded, r.prompt), max_new_tokens, context, False, str(r.id))
        for r in records
    ]
    runners, settings, spec, dart, sizes = {}, {}, None, None, None
    context = int(np.median([len(p) for p in prompt_ids])) + max_new_tokens // 2
    for method in methods:
        if method in ("ar", "hf"):
            runners[method] = _run_hf if method == "hf" else _run_dflax
            settings[method] = {"block_size": None, "tree_budget": None}
            continue
        if method == "official":  # the reference DFlash with the drafter the dflash rows run
            from dflax.drafters import SHIPPED
            from dflax.drafters.shipped import named_drafter_path, shipped_drafter_path
            from dflax.reference import bench_runner, check_reference_installed, official_drafter_dir

            check_reference_installed()
            source = drafter or SHIPPED
            path = shipped_drafter_path(loaded.name) if source == SHIPPED else named_drafter_path(source)
            official = official_drafter_dir(path or source)
            runners[method] = functools.partial(bench_runner, drafter=official)
            settings[method] = {"block_size": load_drafter_checkpoint(official, jnp.float32)[0].block_size}
            settings[method]["tree_budget"] = None
            continue
        if method == "diffuspec":
            for name, diffuspec, setting in _diffuspec_runs(
                drafter, loaded, diffuspec_windows, refine_steps, cps_modes
            ):
                runners[name] = functools.partial(_run_dflax, drafter=diffuspec)
                settings[name] = setting
            continue
        from dflax.drafters import SHIPPED, DraftSampling, load_drafter, prompt_lookup
        from dflax.drafters.dart_checkpoint import is_dart_dir
        from dflax.drafters.dart_loader import DART_TREE_BUDGET, load_dart
        from dflax.drafters.lookup import DEFAULT_MIN_MATCH, LOOKUP_BLOCK_SIZE

        budgets = tree_budgets or [0]
        if method == "dart":
            if drafter is None:
                raise ValueError(
                    "--method dart needs --drafter: a DART drafter directory (`dflax train --config "
                    "configs/train/dart-smollm2.json` exports one) or 'untrained'"
                )
            if draft_sampling == "sample":
                raise ValueError("DART drafts greedily (its trees are verified by the delta rule)")
            dart = method_drafter = load_dart(drafter, loaded)
            default = AUTO if dart.accept and not tree_budgets else dart.trained_block_size
            method_sizes = block_sizes or [default]
            if AUTO in method_sizes and (tree_budgets or not dart.accept):
                raise ValueError(
                    "--block-size auto chooses DART's chain or tree from its measured acceptance: use it "
                    "without --tree-budget, with a drafter whose TRAINING.json records acceptance"
                )
            budgets = tree_budgets or ([0] if AUTO in method_sizes else [DART_TREE_BUDGET])
        elif method == "lookup":
            match = DEFAULT_MIN_MATCH if lookup_min_match is None else lookup_min_match
            method_drafter = prompt_lookup(min_match=match)
            method_sizes = block_sizes or [LOOKUP_BLOCK_SIZE]
            if AUTO in method_sizes:
                raise ValueError("--block-size auto needs a drafter's measured acceptance; lookup has none")
        else:
            from dflax.drafters.diffuspec_loader import is_diffuspec_drafter_dir

            other_dir = drafter is not None and (
                is_dart_dir(Path(drafter)) or is_diffuspec_drafter_dir(drafter)
            )
            dflash_dir = None if other_dir else drafter
            chains = not any(tree_budgets or [0])
            sampling = DraftSampling.for_target(draft_sampling, temperature, tree=not chains)
            spec = method_drafter = load_drafter(dflash_dir or SHIPPED, loaded, draft_sampling=sampling)
            default = AUTO if spec.accept and chains else spec.proposer.block_size
            sizes = method_sizes = block_sizes or [default]
            if AUTO in sizes and not chains:
                raise ValueError("--block-size auto chooses chains; give block sizes with --tree-budget")
        for b in method_sizes:
            for n in budgets:
                name = method + (f"-{b}" if b == AUTO else f"-b{b}" if len(method_sizes) > 1 else "")
                name += f"-t{n}" if len(budgets) > 1 else ""
                if b == AUTO:  # the block size is chosen per batch size; the run reports it
                    runners[name] = functools.partial(
                        _run_auto, drafter=method_drafter, context=context, trees=tree_budgets is None
                    )
                    settings[name] = {}  # the run reports the chosen block size and tree budget
                    continue
                row_drafter = method_drafter.with_block_size(b)
                if method == "dflash":  # as the row would alone: a chain beside trees samples at T > 0
                    row_sampling = DraftSampling.for_target(draft_sampling, temperature, tree=bool(n))
                    row_drafter = row_drafter.with_draft_sampling(row_sampling)
                row_drafter = row_drafter.with_tree_budget(n)
                runners[name] = functools.partial(_run_dflax, drafter=row_drafter)
                settings[name] = {"block_size": b, "tree_budget": n}
                if method == "dflash":
                    settings[name]["draft_sampling"] = row_drafter.proposer.draft_sampling.mode
                if method == "lookup":
                    settings[name]["min_match"] = method_drafter.proposer.min_match
    if "auto" in shared_prefix:  # each dflax method also (or only) with shared prefixes
        for name, runner in list(runners.items()):
            if name in ("hf", "official"):
                continue
            runners[f"{name}-shared"] = functools.partial(runner, shared_prefix="auto")
            settings[f"{name}-shared"] = settings[name]
            if "none" not in shared_prefix:
                del runners[name]
    runners = _with_refills(runners, settings, refill_every or [0], mesh)
    batch_sizes = [batch_size] if isinstance(batch_size, int) else list(batch_size)
    roofline = measure_roofline(loaded.params)
    outputs, results = {}, []
    with Progress(console=console, disable=console is None) as progress:
        for rows in batch_sizes:
            rounds: dict[str, list[dict[str, Any]]] = {method: [] for method in runners}
            for round_index in range(rounds_per_method):
                for method, runner in runners.items():
                    label = f"{method} batch {rows}"
                    if rounds_per_method > 1:
                        label += f", round {round_index + 1}/{rounds_per_method}"
                    task = progress.add_task(label, total=len(prompt_ids))
                    tokens, per_batch = runner(
                        loaded,
                        prompt_ids,
                        max_new_tokens,
                        temperature,
                        rows,
                        seed,
                        lambda k, task=task: progress.advance(task, k),
                    )
                    outputs.setdefault((method, rows), tokens)
                    rounds[method].append(_summary(method, rows, per_batch))
            for method, summaries in rounds.items():
                result = {**_median_round(summaries), **settings[method]}
                if result["step_s"]:
                    result["step_vs_floor"] = result["step_s"] / step_floor_s(
                        roofline, min(rows, len(prompt_ids))
                    )
                results.append(result)
    for r in results:
        ar = next((a for a in results if a["method"] == "ar" and a["batch_size"] == r["batch_size"]), None)
        if ar is None:
            continue
        r["ar_tokens_per_s"] = ar["tokens_per_s"]
        r["speedup"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else None
        if rounds_per_method > 1:  # round i against ar's round i, which ran just before it
            r["round_speedups"] = [
                x / a if a else None for x, a in zip(r["round_tokens_per_s"], ar["round_tokens_per_s"])
            ]
        if temperature == 0:
            reference, got = outputs["ar", r["batch_size"]], outputs[r["method"], r["batch_size"]]
            r["lossless_match"] = float(np.mean([a == b for a, b in zip(reference, got)]))
            r["first_differences"] = first_differences(loaded, prompt_ids, reference, got)
    _add_projection(results, loaded, spec, len(prompt_ids), dart)
    report = {
        "target": target,
        "prompts": prompts,
        "n_prompts": len(prompt_ids),
        "batch_sizes": batch_sizes,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "mesh": mesh,
        "machine": machine_facts(),
        "dtype": jnp.dtype(loaded.dtype).name,
        "drafter": spec.name if spec else None,
        "draft_sampling": dataclasses.asdict(spec.proposer.draft_sampling) if spec else None,
        "dart_drafter": dart.name if dart else None,
        "block_sizes": sizes,
        "tree_budgets": tree_budgets or [0],
        "refill_every": refill_every or [0],
        "rounds_per_method": rounds_per_method,
        "roofline": roofline,
        "projection": projection.DESCRIPTION,
        "results": results,
    }
    if cost_curve:
        fixed = [b for b in sizes or [] if b != AUTO]  # the draft is timed at the last block size run
        curve_drafter = spec.with_block_size(fixed[-1]) if spec is not None and fixed else spec
        report["cost_curve"] = measure_cost_curve(
            loaded,
            curve_drafter,
            context=int(np.median([len(p) for p in prompt_ids])),
            sizes=tuple(cost_curve_sizes),
        )
    return report
