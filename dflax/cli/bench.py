"""`dflax bench`: decode tokens/s of methods on one prompt set."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dflax.checkpoints.registry import DEFAULT_TARGET
from dflax.cli.app import app
from dflax.cli.common import (
    DRAFT_SAMPLING_HELP,
    DRAFTER_HELP,
    MESH_HELP,
    MIN_MATCH_HELP,
    REFINE_HELP,
    SHARED_PREFIX_HELP,
    SYSTEM_PROMPT_HELP,
    TARGET_HELP,
    WINDOW_HELP,
    block_size_value,
    check_diffuspec_options,
    check_lookup_options,
    console,
    fail,
    read_system_prompt,
)


@app.command()
def bench(
    prompts: str = typer.Option("humaneval", help="humaneval, mtbench or a JSONL prompt file"),
    target: str = typer.Option(DEFAULT_TARGET, help=TARGET_HELP),
    method: str = typer.Option(
        "ar",
        help="comma-separated: ar (plain decoding), dflash (shipped or --drafter), dart (--drafter DART "
        "directory), lookup (prompt lookup), diffuspec (--drafter diffusion LM directory), hf (transformers)",
    ),
    drafter: str = typer.Option(None, help=DRAFTER_HELP),
    window: str = typer.Option(None, help=WINDOW_HELP + "; several (auto,16: one diffuspec run each)"),
    refine_steps: int = typer.Option(1, help=REFINE_HELP),
    cps: str = typer.Option(
        "on", help="diffuspec: CPS on, off, or on,off (one run each; off: each slot's argmax)"
    ),
    block_size: str = typer.Option(
        None,
        help="block size B, auto, or several (8,16,auto: one run each of dflash, dart and lookup; auto is "
        "dflash's and dart's); default: auto for a drafter with measured acceptance (the shipped one, and "
        "any that `dflax train` exported) without --tree-budget, else the trained B (lookup: 8)",
    ),
    tree_budget: str = typer.Option(
        None,
        help="tree budget N, or several (0,16,32: one dflash / dart / lookup run each; 0 = a chain; dart's "
        "default without measured acceptance 60)",
    ),
    draft_sampling: str = typer.Option("auto", help=DRAFT_SAMPLING_HELP),
    min_match: int = typer.Option(None, help=MIN_MATCH_HELP),
    cost_curve: bool = typer.Option(
        False, "--cost-curve", help="time verify forwards for n=1..32 and a draft"
    ),
    limit: int = typer.Option(40, help="use the first N prompts"),
    max_new_tokens: int = typer.Option(128, help="new tokens per prompt"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    batch_size: str = typer.Option(
        "1", help="prompts decoded together, or several (8,64: each method at each)"
    ),
    seed: int = typer.Option(0, help="sampling seed"),
    json_out: Path = typer.Option(None, "--json", help="write the results as JSON"),
    plot: Path = typer.Option(
        None, "--plot", help="draw accepted lengths, tau/speedup per block size and the cost curve (PNG)"
    ),
    dtype: str = typer.Option(
        None, help="dflax's target dtype: float32 (CPU default), bfloat16 (faster with AVX-512 BF16)"
    ),
    mesh: str = typer.Option(None, help=MESH_HELP),
    refill_every: str = typer.Option(
        "0",
        help="0 = static batches; k > 0 = continuous batching, finished rows refilled every k decode "
        "steps; several (0,16) run each method once per value",
    ),
    shared_prefix: str = typer.Option(
        "none",
        help="none, auto, or both (none,auto: each dflax method once without and once with shared "
        "prefixes, the latter reported as METHOD-shared with prefix KV bytes). " + SHARED_PREFIX_HELP,
    ),
    system_prompt: Path = typer.Option(None, help=SYSTEM_PROMPT_HELP),
    rounds: int = typer.Option(
        1,
        min=1,
        help="run every method this many times, round by round (ar, dflash, ar, dflash, ...); each "
        "result is its median round, speedups divide medians and round_speedups lists round i over ar's "
        "round i",
    ),
) -> None:
    """Measure decode tokens/s of methods on one prompt set, back to back in one run."""
    from dflax.bench import BENCH_METHODS, run_bench

    methods = [m.strip() for m in method.split(",") if m.strip()]
    for m in methods:
        if m not in BENCH_METHODS:
            fail(f"unknown bench method {m!r}; available: {', '.join(BENCH_METHODS)}")
    check_diffuspec_options(methods, window, refine_steps, cps)
    check_lookup_options(methods, min_match)
    cps_modes = [c.strip() for c in cps.split(",")]
    if not cps_modes or any(c not in ("on", "off") for c in cps_modes):
        fail(f"--cps {cps!r}: give on, off or on,off")
    try:
        batch_sizes = [int(b) for b in batch_size.split(",")]
    except ValueError:
        fail(f"--batch-size {batch_size!r}: give positive integers, e.g. 8 or 8,64")
    if any(b < 1 for b in batch_sizes):
        fail(f"--batch-size {batch_size!r}: give positive integers, e.g. 8 or 8,64")
    if plot and not {"dflash", "dart", "lookup"} & set(methods) and not cost_curve:
        fail(
            "--plot draws speculative results and the cost curve: add --method ...,dflash (or lookup) or "
            "--cost-curve"
        )
    shared_modes = [m.strip() for m in shared_prefix.split(",") if m.strip()]
    if not shared_modes or any(m not in ("auto", "none") for m in shared_modes):
        fail(f"--shared-prefix {shared_prefix!r}: give none, auto or none,auto")
    system = read_system_prompt(system_prompt) if system_prompt else None
    block_sizes = [block_size_value(b.strip()) for b in block_size.split(",")] if block_size else None
    try:
        refills = [int(k) for k in refill_every.split(",")]
    except ValueError:
        fail(f"--refill-every {refill_every!r}: give integers >= 0, e.g. 16 or 0,16")
    tree_budgets = None
    if tree_budget:
        try:
            tree_budgets = [int(n) for n in tree_budget.split(",")]
        except ValueError:
            fail(f"--tree-budget {tree_budget!r}: give integers >= 0, e.g. 16 or 0,16,32")
        if any(n < 0 for n in tree_budgets):
            fail(f"--tree-budget {tree_budget!r}: give integers >= 0, e.g. 16 or 0,16,32")
    try:
        report = run_bench(
            prompts=prompts,
            target=target,
            methods=methods,
            limit=limit,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            batch_size=batch_sizes,
            seed=seed,
            drafter=drafter,
            block_sizes=block_sizes,
            tree_budgets=tree_budgets,
            draft_sampling=draft_sampling,
            cost_curve=cost_curve,
            console=console,
            mesh=mesh,
            dtype=dtype,
            refill_every=refills,
            shared_prefix=shared_modes,
            system_prompt=system,
            diffuspec_windows=[w.strip() for w in (window or "auto").split(",")],
            refine_steps=refine_steps,
            cps_modes=[c == "on" for c in cps_modes],
            lookup_min_match=min_match,
            rounds_per_method=rounds,
        )
    except (ValueError, ImportError, FileNotFoundError) as e:
        fail(str(e))
    text = json.dumps(report, indent=2)
    if json_out:
        json_out.write_text(text + "\n")
    print(text)
    if plot:
        from dflax.plots import bench_figure

        try:
            figure = bench_figure(json.loads(text))  # as read back from --json: the same keys
        except ValueError as e:
            fail(f"--plot: {e}")
        plot.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(plot, dpi=120)
        console.print(f"plot written to {plot}")
