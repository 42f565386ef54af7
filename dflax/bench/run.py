"""`dflax bench`: decode speed of methods on one prompt set, measured back to back in one run.

Every method sees the same token ids. Each compiled shape is warmed up before timing. Decode tokens/s
counts the tokens produced after the first one (which comes out of prefill) over decode time only;
prefill time is reported separately.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from dflax.bench.runners import diffuspec_runs, run_auto, run_dflax, run_hf, with_refills
from dflax.bench.summary import add_projection, median_round, summarize
from dflax.divergence import first_differences
from dflax.drafters.checkpoint import load_drafter_checkpoint
from dflax.drafters.dflash import DRAFT_SAMPLING_MODES
from dflax.generation import encode_prompt, fit_to_context
from dflax.planning import projection
from dflax.planning.auto import AUTO  # a block size chosen by the cost model
from dflax.planning.cost_curve import COST_CURVE_SIZES, measure_cost_curve
from dflax.planning.roofline import machine_facts, measure_roofline, step_floor_s
from dflax.prompts import load_prompts, with_system_prompt
from dflax.target import load_target

BENCH_METHODS = ("ar", "dflash", "dart", "lookup", "diffuspec", "hf", "official")


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
        of median tokens/s (see `median_round`), and outputs and lossless_match are the first round's.

    Returns:
      {"target", "prompts", "n_prompts", "batch_sizes", "max_new_tokens", "temperature", "machine" (CPU model
      and flags, devices: `dflax.planning.roofline.machine_facts`), "roofline", "results": [...]}, one result
      per method and batch size with tokens_per_s (decode only), prefill_s, prefill_tokens_per_s, tau,
      accept_hist (steps by tokens committed = accepted depth + 1), block_size and tree_budget (None for ar
      and hf), step_s and step_vs_floor (one decode-loop iteration against this machine's floor for that many
      rows, see dflax.planning.roofline), and, when "ar" ran too, ar_tokens_per_s, speedup and, at T=0,
      lossless_match (fraction of prompts token-identical to ar) and first_differences (where each other
      output leaves ar's and the target's logits there, see `dflax.divergence.first_differences`: near-ties
      show as gaps of a few hundredths).
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
            runners[method] = run_hf if method == "hf" else run_dflax
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
            for name, diffuspec, setting in diffuspec_runs(
                drafter, loaded, diffuspec_windows, refine_steps, cps_modes
            ):
                runners[name] = functools.partial(run_dflax, drafter=diffuspec)
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
                        run_auto, drafter=method_drafter, context=context, trees=tree_budgets is None
                    )
                    settings[name] = {}  # the run reports the chosen block size and tree budget
                    continue
                row_drafter = method_drafter.with_block_size(b)
                if method == "dflash":  # as the row would alone: a chain beside trees samples at T > 0
                    row_sampling = DraftSampling.for_target(draft_sampling, temperature, tree=bool(n))
                    row_drafter = row_drafter.with_draft_sampling(row_sampling)
                row_drafter = row_drafter.with_tree_budget(n)
                runners[name] = functools.partial(run_dflax, drafter=row_drafter)
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
    runners = with_refills(runners, settings, refill_every or [0], mesh)
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
                    rounds[method].append(summarize(method, rows, per_batch))
            for method, summaries in rounds.items():
                result = {**median_round(summaries), **settings[method]}
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
    add_projection(results, loaded, spec, len(prompt_ids), dart)
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
