"""`dflax generate`: completions for prompts given as arguments or in a JSONL file."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dflax.checkpoints.registry import DEFAULT_TARGET
from dflax.cli.app import app
from dflax.cli.common import (
    CPS_HELP,
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
    check_method,
    console,
    fail,
    load_target_or_fail,
    read_system_prompt,
)
from dflax.cli.drafter_options import load_diffuspec_or_fail, load_drafter_or_fail
from dflax.cli.totals import RunTotals


@app.command()
def generate(
    prompts: list[str] = typer.Argument(None, help="prompts (raw completion unless --chat)"),
    prompts_file: Path = typer.Option(None, "--prompts", help="JSONL file: {id, prompt} or {id, messages}"),
    out: Path = typer.Option(
        None, "--out", help="JSONL results, written as each prompt completes; reruns resume"
    ),
    target: str = typer.Option(DEFAULT_TARGET, help=TARGET_HELP),
    method: str = typer.Option(
        "ar",
        help="ar (plain autoregressive), dflash (speculative, lossless; the drafter dflax ships for the "
        "target unless --drafter is given), dart (speculative, lossless: DART trees from --drafter DIR) or "
        "lookup (prompt lookup: drafts copied from the prompt and output, lossless, no drafter) or "
        "diffuspec (a masked diffusion LM from --drafter DIR drafts a window, CPS + ADL, lossless)",
    ),
    drafter: str = typer.Option(None, help=DRAFTER_HELP),
    window: str = typer.Option(None, help=WINDOW_HELP),
    refine_steps: int = typer.Option(1, help=REFINE_HELP),
    cps: bool = typer.Option(True, "--cps/--no-cps", help=CPS_HELP),
    block_size: str = typer.Option(
        None,
        help="block size B (anchor + B-1 drafts) or auto (DFlash and DART: the cost model's pick of a chain, "
        "or of a tree when the drafter recorded rank acceptance and --tree-budget is not given; plain "
        "decoding when nothing pays); default: auto for a drafter with measured acceptance (the shipped "
        "one, and any that `dflax train` exported), else the drafter's trained B (lookup: 8)",
    ),
    tree_budget: int = typer.Option(
        None,
        help="verify a tree of N nodes per step (dflash: best first over the drafter's block; dart: its "
        "n-gram-pruned beam, default 60 for a drafter without measured acceptance; lookup: several "
        "occurrences' continuations); 0 = a chain",
    ),
    draft_sampling: str = typer.Option("auto", help=DRAFT_SAMPLING_HELP),
    min_match: int = typer.Option(None, help=MIN_MATCH_HELP),
    chat: bool = typer.Option(False, "--chat", help="wrap argument prompts as a user chat message"),
    max_new_tokens: int = typer.Option(128, help="new tokens per prompt"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, help="nucleus mass (1 = off)"),
    top_k: int = typer.Option(0, help="top-k (0 = off)"),
    seed: int = typer.Option(0, help="sampling seed"),
    batch_size: int = typer.Option(8, help="prompts decoded together"),
    refill_every: int = typer.Option(
        16,
        help="continuous batching: every N decode steps, rows that finished take the next prompts "
        "(0 = static batches that run until their longest row ends; always static on a --mesh); outputs are "
        "the same",
    ),
    truncate: bool = typer.Option(
        False, "--truncate", help="keep the last tokens of prompts that do not fit"
    ),
    dtype: str = typer.Option(
        None, help="float32 (CPU default) or bfloat16 (about 1.5x faster on CPUs with AVX-512 BF16)"
    ),
    num_shards: int = typer.Option(
        1, help="split --prompts into K shards by id (one process per shard, each with its own --out)"
    ),
    shard_index: int = typer.Option(0, help="which shard this process generates (0 .. K-1)"),
    mesh: str = typer.Option(None, help=MESH_HELP),
    coordinator: str = typer.Option(
        None,
        help="multi-host: host:port of process 0. Every process runs the same command (the same --prompts "
        "and --mesh, which spans all processes' devices) with its own --process-id and --out, and writes the "
        "prompts of its id shard; the union of the files is the one-process output",
    ),
    num_processes: int = typer.Option(1, help="multi-host: processes in the run (with --coordinator)"),
    process_id: int = typer.Option(0, help="multi-host: this process's id, 0 .. P-1 (with --coordinator)"),
    shared_prefix: str = typer.Option("none", help=SHARED_PREFIX_HELP),
    num_samples: int = typer.Option(
        1,
        help="N samples per prompt (needs --temperature > 0), decoded side by side under the prompt as a "
        "shared prefix with --shared-prefix auto; results carry ids [id, k], each seeded by its own id",
    ),
    system_prompt: Path = typer.Option(None, help=SYSTEM_PROMPT_HELP),
) -> None:
    """Generate completions for prompts given as arguments or in a JSONL file."""
    from dflax.generation import generate as run_generate
    from dflax.planning.auto import uses_auto
    from dflax.prompts import (
        PromptRecord,
        completed_ids,
        expand_samples,
        read_prompt_file,
        result_key,
        result_line,
        row_seed,
        select_shard,
        shard_of,
        with_system_prompt,
    )

    check_method(method)
    check_diffuspec_options([method], window, refine_steps, cps)
    check_lookup_options([method], min_match)
    if shared_prefix not in ("auto", "none"):
        fail(f"--shared-prefix must be auto or none, got {shared_prefix!r}")
    if num_samples < 1:
        fail(f"--num-samples must be a positive integer, got {num_samples}")
    if num_samples > 1 and temperature <= 0:
        fail("--num-samples N > 1 draws different samples: give --temperature > 0 (greedy repeats one)")
    if max_new_tokens < 1:
        fail(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    if batch_size < 1:
        fail(f"--batch-size must be a positive integer, got {batch_size}")
    if refill_every < 0:
        fail(f"--refill-every must be >= 0 (0 = static batches), got {refill_every}")
    if bool(prompts) == bool(prompts_file):
        fail("give prompts as arguments or with --prompts FILE.jsonl (exactly one of the two)")
    if (num_shards, shard_index) != (1, 0) and not prompts_file:
        fail("--num-shards/--shard-index split a --prompts file; give one")
    if coordinator is None and (num_processes, process_id) != (1, 0):
        fail("--num-processes/--process-id need --coordinator host:port (process 0's address)")
    if coordinator is not None:
        if not (prompts_file and out and mesh):
            fail("a multi-host run (--coordinator) needs --prompts, --out (one file per process) and --mesh")
        if num_shards != 1:
            fail("--coordinator splits the prompts over the processes itself; leave out --num-shards")
        from dflax.sharding.multihost import initialize

        try:
            initialize(coordinator, num_processes, process_id)
        except ValueError as e:
            fail(str(e))
    bad = []
    if prompts_file:
        if not prompts_file.is_file():
            fail(f"--prompts {prompts_file}: no such file")
        records, bad = read_prompt_file(prompts_file)
        for line in bad:
            console.print(f"[yellow]skipping {prompts_file}:{line}[/]")
        try:
            records = select_shard(records, num_shards, shard_index)
        except ValueError as e:
            fail(str(e))
        if num_shards > 1:
            console.print(f"shard {shard_index} of {num_shards}: {len(records)} prompts")
    else:
        records = [
            PromptRecord(i, [{"role": "user", "content": p}] if chat else p) for i, p in enumerate(prompts)
        ]
    if system_prompt:
        records = with_system_prompt(records, read_system_prompt(system_prompt))
    records = expand_samples(records, num_samples)
    done = completed_ids(out) if out else set()
    if coordinator is not None:  # ids done by any process: every process then builds the same batches
        from dflax.sharding.multihost import any_process

        finished = any_process([result_key(r.id) in done for r in records])
        done = {result_key(r.id) for r, f in zip(records, finished) if f}
    todo = [r for r in records if result_key(r.id) not in done]
    if done:
        console.print(f"{out}: {len(records) - len(todo)} of {len(records)} prompts already done, resuming")

    fixed_block = block_size_value(block_size) if block_size else None
    fixed = fixed_block if fixed_block != "auto" else None
    loaded = load_target_or_fail(target, dtype, mesh)
    if method == "diffuspec":
        spec_drafter = load_diffuspec_or_fail(
            drafter, loaded, window, refine_steps, cps, block_size, tree_budget, draft_sampling
        )
    else:
        spec_drafter = load_drafter_or_fail(
            method, drafter, loaded, fixed, draft_sampling, temperature, tree_budget, min_match
        )
    # static batches on a mesh and with shared prefixes
    refills = None if mesh or shared_prefix == "auto" else refill_every or None
    try:
        auto = uses_auto(spec_drafter, fixed_block, tree_budget)
    except ValueError:
        fail(
            "--block-size auto chooses a DFlash or DART chain or tree itself; with lookup or --tree-budget N "
            "give --block-size B"
        )
    if auto and coordinator is not None:  # each process would time its own steps and might choose another B
        fail("--block-size auto times this machine's decode steps; give every process --block-size B")
    sink = None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = out.exists() and out.stat().st_size > 0 and not out.read_bytes().endswith(b"\n")
        sink = out.open("a", encoding="utf-8")
        if needs_newline:  # a torn line from an interrupted run stays alone on its line
            sink.write("\n")
    totals = RunTotals(speculative=spec_drafter is not None and not auto)  # auto: once it speculates
    progress = Progress(
        TextColumn("generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not prompts_file,
    )
    try:
        with progress:
            task = progress.add_task("generate", total=len(todo), rate="compiling ...")

            def on_result(i, result):
                record = todo[i]
                if sink and (coordinator is None or shard_of(record.id, num_processes) == process_id):
                    sink.write(result_line(record.id, result) + "\n")
                    sink.flush()
                else:
                    print(
                        result.text if len(todo) == 1 else json.dumps({"id": record.id, "text": result.text})
                    )
                totals.add(result.stats)
                progress.update(task, advance=1, rate=totals.rate())

            def on_plan(event, choice):
                if event == "timing":
                    timing = "block size auto: timing decode steps (once per machine and shape) ..."
                    progress.update(task, rate=timing)
                    if progress.disable:
                        console.print(timing)
                    return
                console.print(choice.describe())
                totals.speculative |= choice.block_size is not None

            run_generate(
                loaded,
                [r.prompt for r in todo],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                batch_size=batch_size,
                truncate=truncate,
                row_seeds=[row_seed(seed, r.id) for r in todo],
                on_result=on_result,
                drafter=spec_drafter,
                tree_budget=tree_budget if spec_drafter is not None else None,
                block_size="auto" if auto else fixed,
                refill_every=refills,
                shared_prefix=shared_prefix,
                on_plan=on_plan,
            )
    except ValueError as e:
        fail(str(e))
    finally:
        if sink:
            sink.close()
    console.print(totals.summary())
    if bad:
        console.print(
            f"[bold red]error:[/] {len(bad)} malformed line(s) in {prompts_file} were skipped: "
            + "; ".join(map(str, bad))
        )
        raise typer.Exit(2)
