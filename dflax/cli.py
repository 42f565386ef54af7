"""The `dflax` command line: generate, bench, make-data, train, validate, pipeline, export, check-reference
and plan."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dflax.checkpoints.registry import DEFAULT_TARGET

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def _process_settings() -> None:
    """Every command: glibc's malloc set for XLA's temporaries (dflax.host_memory)."""
    from dflax.host_memory import configure_malloc

    configure_malloc()


# Messages are not wrapped at the console width: paths and error lines stay whole in logs and pipes.
console = Console(stderr=True, soft_wrap=True)

_TARGET_HELP = "built-in name (smollm2-135m, gemma3-270m), a .gguf file or an HF checkpoint directory"
_METHODS = ("ar", "dflash", "dart", "lookup", "diffuspec")
_DRAFTER_HELP = (
    "DFlash drafter directory (official z-lab/dflash layout) or, with --method dart, a DART drafter "
    "directory, or with --method diffuspec, a masked diffusion LM directory; 'untrained' (random, for "
    "tests); default (dflash): the drafter dflax ships for the target"
)


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def _check_method(method: str) -> None:
    if method not in _METHODS:
        _fail(f"unknown method {method!r}; available: {', '.join(_METHODS)}")


class _Totals:
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


def _load_drafter(
    method: str,
    drafter: str | None,
    loaded,
    block_size: int | None,
    draft_sampling: str,
    temperature: float,
    tree_budget: int | None = None,
    min_match: int | None = None,
):
    """The drafter for --method dflash, dart or lookup (None for ar), with one clear error for bad input;
    `draft_sampling` ("auto", "greedy" or "sample") is resolved for the target's `temperature`."""
    from dflax.drafters.dflash import DRAFT_SAMPLING_MODES

    if draft_sampling not in DRAFT_SAMPLING_MODES:
        _fail(f"--draft-sampling {draft_sampling!r}: use auto, greedy or sample")
    if tree_budget is not None and method == "ar":
        _fail(
            "--tree-budget needs --method dflash, dart or lookup (plain decoding verifies one token per step)"
        )
    if method == "ar":
        return None
    from dflax.drafters import SHIPPED, DraftSampling, load_drafter, prompt_lookup
    from dflax.drafters.dart_loader import DART_TREE_BUDGET, load_dart
    from dflax.drafters.lookup import DEFAULT_MIN_MATCH, LOOKUP_BLOCK_SIZE

    try:
        if method == "lookup":
            match = DEFAULT_MIN_MATCH if min_match is None else min_match
            return prompt_lookup(block_size or LOOKUP_BLOCK_SIZE, tree_budget or 0, match)
        if method == "dart":
            if drafter is None:
                _fail(
                    "--method dart needs --drafter: a DART drafter directory (`dflax train --config "
                    "configs/train/dart-smollm2.json` exports one) or 'untrained'"
                )
            if draft_sampling == "sample":
                _fail(
                    "--method dart drafts greedily (its trees are verified by the delta rule): drop "
                    "--draft-sampling"
                )
            dart = load_dart(drafter, loaded, DART_TREE_BUDGET if tree_budget is None else tree_budget)
            return dart.with_block_size(block_size) if block_size else dart
        sampling = DraftSampling.for_target(draft_sampling, temperature, tree=bool(tree_budget))
        loaded_drafter = load_drafter(
            drafter or SHIPPED, loaded, block_size=block_size, draft_sampling=sampling
        )
        return loaded_drafter.with_tree_budget(tree_budget) if tree_budget else loaded_drafter
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


_DRAFT_SAMPLING_HELP = (
    "dflash: greedy (argmax drafts, delta rule), sample (drafts drawn from the drafter's q, block "
    "verification) or auto: greedy at --temperature 0 and with a draft tree, sample otherwise"
)
_MIN_MATCH_HELP = (
    "lookup: verify drafts only in steps where some row's last N tokens (0..3) occurred before, else take a "
    "plain one-token step; 0 = always verify (default 2)"
)
_WINDOW_HELP = (
    "diffuspec: auto (adaptive draft length k in [20, 30], a window of 30 verified per step), MIN:MAX "
    "(adaptive k in those bounds) or K (a fixed k); default auto"
)
_REFINE_HELP = "diffuspec: diffusion forwards per draft (1 as published)"
_CPS_HELP = "diffuspec: causal-consistency path search over the lattice (--no-cps: each slot's argmax)"


def _load_diffuspec(
    drafter: str | None,
    loaded,
    window: str | None,
    refine_steps: int,
    cps: bool,
    block_size: str | None,
    tree_budget: int | None,
    draft_sampling: str,
):
    """The DiffuSpec drafter of --method diffuspec, with one clear error for bad input."""
    from dflax.drafters.diffuspec_loader import WindowSetting, load_diffuspec

    if block_size or tree_budget or draft_sampling == "sample":
        _fail(
            "--method diffuspec drafts one chain of --window slots greedily: drop --block-size, "
            "--tree-budget and --draft-sampling"
        )
    try:
        return load_diffuspec(drafter, loaded, WindowSetting.parse(window or "auto"), refine_steps, cps)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def _check_diffuspec_options(methods, window: str | None, refine_steps: int, cps) -> None:
    """--window, --refine-steps and --cps only with --method diffuspec."""
    if "diffuspec" not in methods and (window is not None or refine_steps != 1 or cps not in (True, "on")):
        _fail("the --window, --refine-steps and --cps options apply to --method diffuspec")


def _check_lookup_options(methods, min_match: int | None) -> None:
    """--min-match only with --method lookup."""
    if min_match is not None and "lookup" not in methods:
        _fail("--min-match applies to --method lookup")


def _block_size_value(text: str) -> int | str:
    """A --block-size value: an integer >= 2 or "auto"; anything else is one clear error."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2:
        _fail(
            f"--block-size {text!r}: give auto or an integer >= 2 (the anchor plus drafts), e.g. 16 or 8,16"
        )
    return value


def _auto_chooser(loaded, records, batch_size: int, max_new_tokens: int, trees: bool, static: bool, sampling):
    """choose(drafter) -> (the drafter at the cost model's block size (or tree budget, with `trees`) for
    this run (static batches or continuous batching, under the target's `sampling`), or None (plain
    decoding); the choice); it says which."""
    from dflax.cost_curve import auto_block_size
    from dflax.generation import cache_slots, encode_prompt, prompt_bucket

    lengths = sorted(len(encode_prompt(loaded, r.prompt)) for r in records) or [1]
    median = lengths[len(lengths) // 2]

    def choose(drafter):
        try:
            with console.status("block size auto: timing decode steps (once per machine and shape) ..."):
                chosen, choice = auto_block_size(
                    loaded,
                    drafter,
                    min(batch_size, max(len(records), 1)),
                    median + max_new_tokens // 2,  # the median prompt, half-way through
                    trees,
                    slots=cache_slots(prompt_bucket(median), max_new_tokens, None),
                    static_tokens=max_new_tokens if static else None,
                    sampling=sampling,
                )
        except ValueError as e:
            _fail(str(e))
        console.print(choice.describe())
        return chosen, choice

    return choose


def _read_recipe(cls, path: Path, label: str, **overrides):
    """A recipe dataclass from its JSON file (with field overrides), or one clear error naming `label`."""
    import dataclasses

    if not path.is_file():
        _fail(f"{label}: no such file")
    try:
        return dataclasses.replace(cls.from_json(path), **overrides)
    except (ValueError, TypeError) as e:
        _fail(f"{label}: {e}")


_MESH_HELP = (
    "shard over a device mesh, data=D,model=M: batch rows split D ways (a batch is padded to a multiple of "
    "D), heads, FFN and vocabulary M ways (tensor parallel); the tokens equal a one-device run"
)


def _load(target: str, dtype: str | None, mesh: str | None = None):
    from dflax.checkpoints.model_files import enable_compilation_cache
    from dflax.target import load_target

    # Compiled decode steps persist across runs: a shape compiles once per machine, not once per command.
    enable_compilation_cache()

    with console.status(f"loading {target} ..."):
        t0 = time.perf_counter()
        try:
            loaded = load_target(target, dtype=dtype, mesh=mesh)
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
    on = f" on mesh {mesh}" if mesh else ""
    console.print(
        f"loaded {target} ({loaded.config.arch}, {loaded.dtype.__name__}){on} in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return loaded


_SHARED_PREFIX_HELP = (
    "auto: a token prefix common to consecutive prompts of a batch (a system message, one prompt's "
    "samples) is prefilled and stored once per group of rows, and runs static batches; none: every row "
    "holds its whole prompt. Outputs are the same"
)
_SYSTEM_PROMPT_HELP = "text file: a system message put in front of every prompt (prompts become chats)"


def _read_system_prompt(path: Path) -> str:
    """The text of a --system-prompt file."""
    if not path.is_file():
        _fail(f"--system-prompt {path}: no such file")
    return path.read_text(encoding="utf-8")


@app.command()
def generate(
    prompts: list[str] = typer.Argument(None, help="prompts (raw completion unless --chat)"),
    prompts_file: Path = typer.Option(None, "--prompts", help="JSONL file: {id, prompt} or {id, messages}"),
    out: Path = typer.Option(
        None, "--out", help="JSONL results, written as each prompt completes; reruns resume"
    ),
    target: str = typer.Option(DEFAULT_TARGET, help=_TARGET_HELP),
    method: str = typer.Option(
        "ar",
        help="ar (plain autoregressive), dflash (speculative, lossless; the drafter dflax ships for the "
        "target unless --drafter is given), dart (speculative, lossless: DART trees from --drafter DIR) or "
        "lookup (prompt lookup: drafts copied from the prompt and output, lossless, no drafter) or "
        "diffuspec (a masked diffusion LM from --drafter DIR drafts a window, CPS + ADL, lossless)",
    ),
    drafter: str = typer.Option(None, help=_DRAFTER_HELP),
    window: str = typer.Option(None, help=_WINDOW_HELP),
    refine_steps: int = typer.Option(1, help=_REFINE_HELP),
    cps: bool = typer.Option(True, "--cps/--no-cps", help=_CPS_HELP),
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
    draft_sampling: str = typer.Option("auto", help=_DRAFT_SAMPLING_HELP),
    min_match: int = typer.Option(None, help=_MIN_MATCH_HELP),
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
    mesh: str = typer.Option(None, help=_MESH_HELP),
    coordinator: str = typer.Option(
        None,
        help="multi-host: host:port of process 0. Every process runs the same command (the same --prompts "
        "and --mesh, which spans all processes' devices) with its own --process-id and --out, and writes the "
        "prompts of its id shard; the union of the files is the one-process output",
    ),
    num_processes: int = typer.Option(1, help="multi-host: processes in the run (with --coordinator)"),
    process_id: int = typer.Option(0, help="multi-host: this process's id, 0 .. P-1 (with --coordinator)"),
    shared_prefix: str = typer.Option("none", help=_SHARED_PREFIX_HELP),
    num_samples: int = typer.Option(
        1,
        help="N samples per prompt (needs --temperature > 0), decoded side by side under the prompt as a "
        "shared prefix with --shared-prefix auto; results carry ids [id, k], each seeded by its own id",
    ),
    system_prompt: Path = typer.Option(None, help=_SYSTEM_PROMPT_HELP),
) -> None:
    """Generate completions for prompts given as arguments or in a JSONL file."""
    from dflax.generation import generate as run_generate
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

    _check_method(method)
    _check_diffuspec_options([method], window, refine_steps, cps)
    _check_lookup_options([method], min_match)
    if shared_prefix not in ("auto", "none"):
        _fail(f"--shared-prefix must be auto or none, got {shared_prefix!r}")
    if num_samples < 1:
        _fail(f"--num-samples must be a positive integer, got {num_samples}")
    if num_samples > 1 and temperature <= 0:
        _fail("--num-samples N > 1 draws different samples: give --temperature > 0 (greedy repeats one)")
    if max_new_tokens < 1:
        _fail(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    if batch_size < 1:
        _fail(f"--batch-size must be a positive integer, got {batch_size}")
    if refill_every < 0:
        _fail(f"--refill-every must be >= 0 (0 = static batches), got {refill_every}")
    if bool(prompts) == bool(prompts_file):
        _fail("give prompts as arguments or with --prompts FILE.jsonl (exactly one of the two)")
    if (num_shards, shard_index) != (1, 0) and not prompts_file:
        _fail("--num-shards/--shard-index split a --prompts file; give one")
    if coordinator is None and (num_processes, process_id) != (1, 0):
        _fail("--num-processes/--process-id need --coordinator host:port (process 0's address)")
    if coordinator is not None:
        if not (prompts_file and out and mesh):
            _fail("a multi-host run (--coordinator) needs --prompts, --out (one file per process) and --mesh")
        if num_shards != 1:
            _fail("--coordinator splits the prompts over the processes itself; leave out --num-shards")
        from dflax.sharding.multihost import initialize

        try:
            initialize(coordinator, num_processes, process_id)
        except ValueError as e:
            _fail(str(e))
    bad = []
    if prompts_file:
        if not prompts_file.is_file():
            _fail(f"--prompts {prompts_file}: no such file")
        records, bad = read_prompt_file(prompts_file)
        for line in bad:
            console.print(f"[yellow]skipping {prompts_file}:{line}[/]")
        try:
            records = select_shard(records, num_shards, shard_index)
        except ValueError as e:
            _fail(str(e))
        if num_shards > 1:
            console.print(f"shard {shard_index} of {num_shards}: {len(records)} prompts")
    else:
        records = [
            PromptRecord(i, [{"role": "user", "content": p}] if chat else p) for i, p in enumerate(prompts)
        ]
    if system_prompt:
        records = with_system_prompt(records, _read_system_prompt(system_prompt))
    records = expand_samples(records, num_samples)
    done = completed_ids(out) if out else set()
    if coordinator is not None:  # ids done by any process: every process then builds the same batches
        from dflax.sharding.multihost import any_process

        finished = any_process([result_key(r.id) in done for r in records])
        done = {result_key(r.id) for r, f in zip(records, finished) if f}
    todo = [r for r in records if result_key(r.id) not in done]
    if done:
        console.print(f"{out}: {len(records) - len(todo)} of {len(records)} prompts already done, resuming")

    fixed_block = _block_size_value(block_size) if block_size else None
    loaded = _load(target, dtype, mesh)
    if method == "diffuspec":
        spec_drafter = _load_diffuspec(
            drafter, loaded, window, refine_steps, cps, block_size, tree_budget, draft_sampling
        )
    else:
        fixed = fixed_block if fixed_block != "auto" else None
        spec_drafter = _load_drafter(
            method, drafter, loaded, fixed, draft_sampling, temperature, tree_budget, min_match
        )
    # static batches on a mesh and with shared prefixes
    refills = None if mesh or shared_prefix == "auto" else refill_every or None
    chains = method in ("dflash", "dart") and not tree_budget
    if fixed_block == "auto" and not chains:
        _fail(
            "--block-size auto chooses a DFlash or DART chain or tree itself; with lookup or --tree-budget N "
            "give --block-size B"
        )
    probe = 0  # prompts decoded before auto chooses again with the acceptance they showed
    if chains and (fixed_block == "auto" or (fixed_block is None and spec_drafter.accept)):
        if coordinator is not None:  # each process would time its own steps and might choose another B
            _fail("--block-size auto times this machine's decode steps; give every process --block-size B")
        import numpy as np

        from dflax.cost_curve import probe_size, scaled_to_probe

        trees = tree_budget is None  # --tree-budget 0 asks for chains
        from dflax.decoding.sampling import SamplingParams

        sampling = SamplingParams.make(temperature, top_k, top_p)  # as run_generate decodes
        choose = _auto_chooser(
            loaded, todo, batch_size, max_new_tokens, trees, static=refills is None, sampling=sampling
        )
        unchosen, (spec_drafter, first_choice) = spec_drafter, choose(spec_drafter)
        if spec_drafter is not None:  # plain decoding measures no acceptance
            probe = probe_size(min(batch_size, len(todo)), len(todo))
    sink = None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = out.exists() and out.stat().st_size > 0 and not out.read_bytes().endswith(b"\n")
        sink = out.open("a", encoding="utf-8")
        if needs_newline:  # a torn line from an interrupted run stays alone on its line
            sink.write("\n")
    totals = _Totals(speculative=spec_drafter is not None)
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

            probe_hist = []

            def on_result(i, result):
                record = todo[i]
                if i < probe:
                    probe_hist.append(result.stats["accept_hist"])
                if sink and (coordinator is None or shard_of(record.id, num_processes) == process_id):
                    sink.write(result_line(record.id, result) + "\n")
                    sink.flush()
                else:
                    print(
                        result.text if len(todo) == 1 else json.dumps({"id": record.id, "text": result.text})
                    )
                totals.add(result.stats)
                progress.update(task, advance=1, rate=totals.rate())

            for start, end in ((0, probe), (probe, len(todo))) if probe else ((0, len(todo)),):
                if start:  # auto again, from the acceptance the first prompts showed
                    hist = np.sum(probe_hist, axis=0)
                    measured, _ = scaled_to_probe(
                        unchosen, hist, first_choice.block_size, first_choice.tree_budget
                    )
                    spec_drafter, _ = choose(measured)
                run_generate(
                    loaded,
                    [r.prompt for r in todo[start:end]],
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    batch_size=batch_size,
                    truncate=truncate,
                    row_seeds=[row_seed(seed, r.id) for r in todo[start:end]],
                    on_result=lambda i, result, start=start: on_result(start + i, result),
                    drafter=spec_drafter,
                    refill_every=refills,
                    shared_prefix=shared_prefix,
                )
    except ValueError as e:
        _fail(str(e))
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


@app.command()
def bench(
    prompts: str = typer.Option("humaneval", help="humaneval, mtbench or a JSONL prompt file"),
    target: str = typer.Option(DEFAULT_TARGET, help=_TARGET_HELP),
    method: str = typer.Option(
        "ar",
        help="comma-separated: ar (plain decoding), dflash (shipped or --drafter), dart (--drafter DART "
        "directory), lookup (prompt lookup), diffuspec (--drafter diffusion LM directory), hf (transformers)",
    ),
    drafter: str = typer.Option(None, help=_DRAFTER_HELP),
    window: str = typer.Option(None, help=_WINDOW_HELP + "; several (auto,16: one diffuspec run each)"),
    refine_steps: int = typer.Option(1, help=_REFINE_HELP),
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
    draft_sampling: str = typer.Option("auto", help=_DRAFT_SAMPLING_HELP),
    min_match: int = typer.Option(None, help=_MIN_MATCH_HELP),
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
    mesh: str = typer.Option(None, help=_MESH_HELP),
    refill_every: str = typer.Option(
        "0",
        help="0 = static batches; k > 0 = continuous batching, finished rows refilled every k decode "
        "steps; several (0,16) run each method once per value",
    ),
    shared_prefix: str = typer.Option(
        "none",
        help="none, auto, or both (none,auto: each dflax method once without and once with shared "
        "prefixes, the latter reported as METHOD-shared with prefix KV bytes). " + _SHARED_PREFIX_HELP,
    ),
    system_prompt: Path = typer.Option(None, help=_SYSTEM_PROMPT_HELP),
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
            _fail(f"unknown bench method {m!r}; available: {', '.join(BENCH_METHODS)}")
    _check_diffuspec_options(methods, window, refine_steps, cps)
    _check_lookup_options(methods, min_match)
    cps_modes = [c.strip() for c in cps.split(",")]
    if not cps_modes or any(c not in ("on", "off") for c in cps_modes):
        _fail(f"--cps {cps!r}: give on, off or on,off")
    try:
        batch_sizes = [int(b) for b in batch_size.split(",")]
    except ValueError:
        _fail(f"--batch-size {batch_size!r}: give positive integers, e.g. 8 or 8,64")
    if any(b < 1 for b in batch_sizes):
        _fail(f"--batch-size {batch_size!r}: give positive integers, e.g. 8 or 8,64")
    if plot and not {"dflash", "dart", "lookup"} & set(methods) and not cost_curve:
        _fail(
            "--plot draws speculative results and the cost curve: add --method ...,dflash (or lookup) or "
            "--cost-curve"
        )
    shared_modes = [m.strip() for m in shared_prefix.split(",") if m.strip()]
    if not shared_modes or any(m not in ("auto", "none") for m in shared_modes):
        _fail(f"--shared-prefix {shared_prefix!r}: give none, auto or none,auto")
    system = _read_system_prompt(system_prompt) if system_prompt else None
    block_sizes = [_block_size_value(b.strip()) for b in block_size.split(",")] if block_size else None
    try:
        refills = [int(k) for k in refill_every.split(",")]
    except ValueError:
        _fail(f"--refill-every {refill_every!r}: give integers >= 0, e.g. 16 or 0,16")
    tree_budgets = None
    if tree_budget:
        try:
            tree_budgets = [int(n) for n in tree_budget.split(",")]
        except ValueError:
            _fail(f"--tree-budget {tree_budget!r}: give integers >= 0, e.g. 16 or 0,16,32")
        if any(n < 0 for n in tree_budgets):
            _fail(f"--tree-budget {tree_budget!r}: give integers >= 0, e.g. 16 or 0,16,32")
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
        _fail(str(e))
    text = json.dumps(report, indent=2)
    if json_out:
        json_out.write_text(text + "\n")
    print(text)
    if plot:
        from dflax.plots import bench_figure

        try:
            figure = bench_figure(json.loads(text))  # as read back from --json: the same keys
        except ValueError as e:
            _fail(f"--plot: {e}")
        plot.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(plot, dpi=120)
        console.print(f"plot written to {plot}")


@app.command("make-data")
def make_data_command(
    config: Path = typer.Option(..., "--config", help="data recipe, e.g. configs/data/smollm2-sharegpt.json"),
    out: Path = typer.Option(..., "--out", help="data directory (shards + manifest.json); reruns resume"),
    limit: int = typer.Option(None, help="answer only the first N prompts of the split"),
    batch_size: int = typer.Option(None, help="prompts decoded together (default: the recipe's)"),
    split: str = typer.Option("train", help="train or validation"),
) -> None:
    """Make drafter training data: chat and code prompts answered by the target, in resumable shards."""
    from dflax.train.make_data import DataConfig, make_data

    recipe = _read_recipe(DataConfig, config, f"--config {config}")
    loaded = _load(recipe.target, None)
    try:
        summary = make_data(
            recipe, out, split=split, limit=limit, batch_size=batch_size, target=loaded, console=console
        )
    except (ValueError, ImportError) as e:
        _fail(str(e))
    seconds = max(summary.seconds, 1e-9)
    console.print(
        f"{out}: {summary.shards_written} shard(s) written, {summary.shards_kept} kept; "
        f"{summary.sequences} sequences, {summary.new_tokens} response tokens in {summary.seconds:.1f}s "
        f"({summary.sequences / seconds:.2f} seq/s, {summary.new_tokens / seconds:.1f} tokens/s, "
        "compilation included)"
    )


@app.command("train")
def train_command(
    config: Path = typer.Option(..., "--config", help="recipe, e.g. configs/train/dflash-smollm2.json"),
    data: Path = typer.Option(..., "--data", help="data directory made by `dflax make-data`"),
    out: Path = typer.Option(..., "--out", help="run directory: checkpoints/, metrics.jsonl, drafter/"),
    steps: int = typer.Option(None, help="total optimizer steps (default: the recipe's steps or epochs)"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="continue from the latest checkpoint"),
    init_from: str = typer.Option(
        None, help="warm start from an exported drafter, 'shipped' or a directory (sets init 'drafter')"
    ),
    lr: float = typer.Option(None, help="peak learning rate (default: the recipe's), e.g. for a sweep"),
    limit: int = typer.Option(
        None, min=1, help="train on the first N training answers (of a data directory that is still growing)"
    ),
    mesh: str = typer.Option(
        None,
        help="train on a device mesh, data=D,model=M: the drafter's parameters and optimizer state split "
        "over data (FSDP) and model, each step's sequences over data (batch_size a multiple of D), the "
        "target whole or split over model; checkpoints resume on any mesh",
    ),
) -> None:
    """Train a drafter (DFlash, DART or an adapted diffusion drafter, by the recipe's method) on
    target-generated data; SIGTERM/Ctrl-C saves a checkpoint to resume from."""

    from dflax.train.dataset import load_sequences
    from dflax.train.diffusion_recipe import DiffusionTrainConfig, is_diffusion_recipe
    from dflax.train.diffusion_trainer import train_diffusion
    from dflax.train.trainer import TrainConfig, train

    overrides = {"steps": steps} if steps is not None else {}
    if init_from is not None:
        overrides.update(init="drafter", init_from=init_from)
    if lr is not None:
        overrides["lr"] = lr
    if is_diffusion_recipe(config):  # method "diffusion": an adapted diffusion drafter (DiffuSpec)
        if init_from is not None:
            _fail("--init-from is for DFlash recipes; a diffusion recipe starts from its source_layers")
        recipe = _read_recipe(DiffusionTrainConfig, config, f"--config {config}", **overrides)
        train = train_diffusion
    else:
        recipe = _read_recipe(TrainConfig, config, f"--config {config}", **overrides)
    try:
        train_seqs = load_sequences(data, "train", limit)
    except FileNotFoundError as e:
        _fail(str(e))
    try:
        val_seqs = load_sequences(data, "validation")
    except FileNotFoundError:
        console.print(f"[yellow]{data} has no validation split: training without validation[/]")
        val_seqs = []
    loaded = _load(recipe.target, None, mesh)
    try:
        result = train(recipe, loaded, train_seqs, val_seqs, out, resume=resume, console=console)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if result.interrupted is not None:
        raise typer.Exit(128 + result.interrupted)


@app.command("validate")
def validate_command(
    drafter: list[str] = typer.Option(
        ["shipped"],
        "--drafter",
        help="'shipped' or a drafter directory made by `dflax train`; repeat to compare",
    ),
    data: list[Path] = typer.Option(
        ..., "--data", help="data directory made by `dflax make-data` (its validation split); repeatable"
    ),
    limit: int = typer.Option(64, min=1, help="held-out answers per data directory (the first ones)"),
    feature_dtype: str = typer.Option("float32", help="precision of the target forward: float32 or bfloat16"),
    recipe: Path = typer.Option(
        None, help="the drafters' training recipe (default: each drafter's TRAINING.json)"
    ),
    cache: Path = typer.Option(
        None, help="keep the target features here for the next call (default: not kept)"
    ),
    json_out: Path = typer.Option(None, "--json", help="also write the rows (every position) as JSON here"),
    target: str = typer.Option(
        None,
        help=f"the drafters' target, {_TARGET_HELP} (default: --recipe's, else the first drafter's "
        f"TRAINING.json's, else {DEFAULT_TARGET})",
    ),
) -> None:
    """Held-out loss, per-position accuracy and estimated tau of drafters on data directories' validation
    answers, with the same anchors for every drafter (no training step)."""
    from dflax.train.trainer import TrainConfig
    from dflax.train.validate import recorded_target, rows_table, validate_drafters

    config = _read_recipe(TrainConfig, recipe, f"--recipe {recipe}") if recipe is not None else None
    if target is None:
        target = config.target if config is not None else recorded_target(drafter[0]) or DEFAULT_TARGET
    loaded = _load(target, None)
    try:
        rows = validate_drafters(
            drafter, data, loaded, limit=limit, feature_dtype=feature_dtype, recipe=config, console=console,
            cache_dir=cache,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    print(rows_table(rows))
    if json_out is not None:
        json_out.write_text(json.dumps([row.to_dict() for row in rows], indent=2) + "\n")
        console.print(f"rows written to {json_out}")


@app.command("pipeline")
def pipeline_command(
    config: Path = typer.Argument(..., help="pipeline recipe, e.g. configs/pipeline/dflash-smollm2.json"),
    dtype: str = typer.Option(
        None, help="the target's dtype: float32, bfloat16 or float16 (default: float32 on CPU, else bf16)"
    ),
    attention_backend: str = typer.Option(
        "auto", help="the target's attention: auto, chunked, reference (plain jnp), pallas, ..."
    ),
) -> None:
    """Make data, train and ship a drafter in one command; rerun it to resume after an interruption."""
    from dflax.train.pipeline import PipelineConfig, run_pipeline

    recipe = _read_recipe(PipelineConfig, config, str(config))
    try:
        result = run_pipeline(recipe, dtype=dtype, attention_backend=attention_backend, console=console)
    except (ValueError, FileNotFoundError, ImportError) as e:
        _fail(str(e))
    if result.interrupted is not None:
        raise typer.Exit(128 + result.interrupted)


@app.command("export")
def export_command(
    drafter: str = typer.Option(
        ..., help="the drafter to export: a drafter directory, a shipped drafter's name, or 'shipped'"
    ),
    out: Path = typer.Option(..., help="directory to write (config.json + model.safetensors)"),
    format: str = typer.Option("official", help="official: the z-lab/dflash layout the reference loads"),
    target: str = typer.Option(DEFAULT_TARGET, help="whose shipped drafter 'shipped' means"),
) -> None:
    """Write a DFlash drafter in the official format (what `DFlashDraftModel.from_pretrained` loads)."""
    from dflax.drafters import SHIPPED
    from dflax.drafters.official import FORMATS, export_official
    from dflax.drafters.shipped import named_drafter_path, shipped_drafter_path

    if format not in FORMATS:
        _fail(f"--format {format!r}: use one of {', '.join(FORMATS)}")
    source = shipped_drafter_path(target) if drafter == SHIPPED else named_drafter_path(drafter)
    try:
        written = export_official(source or drafter, out)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    console.print(f"wrote {written} in the {format} format")


@app.command("check-reference")
def check_reference_command(
    drafter: str = typer.Option(
        "smollm2-135m-official", help="an official-format DFlash drafter: a directory or a shipped name"
    ),
    target: str = typer.Option(DEFAULT_TARGET, help="built-in name, a .gguf file or an HF directory"),
    prompts: str = typer.Option("humaneval", help="humaneval, mtbench or a JSONL prompt file"),
    limit: int = typer.Option(8, help="use the first N prompts"),
    max_new_tokens: int = typer.Option(64, help="new tokens per prompt"),
) -> None:
    """Decode greedily with dflax and with the reference DFlash (`dflash`) on one drafter: do they agree?"""
    from dflax.drafters import load_drafter
    from dflax.generation import encode_prompt
    from dflax.prompts import load_prompts
    from dflax.reference import check_reference_installed, compare

    try:
        check_reference_installed()
        records, bad = load_prompts(prompts)
        if bad:
            _fail(f"{prompts}: malformed lines: " + "; ".join(map(str, bad)))
        loaded = _load(target, "float32")
        spec = load_drafter(drafter, loaded)
        ids = [encode_prompt(loaded, r.prompt) for r in records[:limit]]
        agreements = compare(loaded, spec, ids, max_new_tokens)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        _fail(str(e))
    for record, a in zip(records, agreements):
        verdict = "agree" if a.same_tokens and a.same_commits else "DIFFER"
        where = "" if a.same_tokens else f", first different token {a.first_token_difference}"
        where += "" if a.same_commits else f", first different step {a.first_step_difference}"
        console.print(
            f"{record.id}: {verdict} (tau dflax {a.dflax_tau:.2f}, reference {a.reference_tau:.2f}, "
            f"{a.compared_steps} steps compared{where})"
        )
    same = sum(a.same_tokens and a.same_commits for a in agreements)
    console.print(f"{same}/{len(agreements)} prompts: identical tokens and tokens per step")
    if same < len(agreements):
        raise typer.Exit(1)


@app.command("plan")
def plan_command(
    model: str = typer.Option(
        "smollm2-135m",
        help="preset (smollm2-135m, gemma3-270m, qwen3-8b, llama-3.1-8b), "
        + _TARGET_HELP
        + " or config.json",
    ),
    drafter: str = typer.Option(
        None,
        help="'none' (plain decoding), 'untrained', 'shipped' or a drafter directory; default: the preset's",
    ),
    topology: str = typer.Option(
        None,
        help="TPU topology compiled for (default v5e:2x2, one device of it; with --mesh the v5e slice "
        "of --devices chips)",
    ),
    mesh: str = typer.Option(
        None, help="data=D,model=M: compile sharded over D * M devices and report bytes per device"
    ),
    platform: str = typer.Option("tpu", help="with --mesh: tpu or cuda"),
    devices: int = typer.Option(None, help="with --mesh: abstract devices (default D * M)"),
    card: str = typer.Option("h100", help="with --platform cuda: h100 or a100"),
    batch: int = typer.Option(1, help="rows decoded together (with --mesh padded to a multiple of D)"),
    prompt_len: int = typer.Option(1024, help="prompt bucket (tokens per row in prefill)"),
    max_new_tokens: int = typer.Option(256, help="new-token budget per row"),
    block_size: int = typer.Option(16, help="tokens verified per step with a drafter"),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32"),
    attention_backend: str = typer.Option("pallas", help="pallas (the TPU/GPU kernel) or reference"),
    stages: str = typer.Option(
        None,
        help="comma-separated stages to compile (prefill, decode_step, decode_loop); default all, "
        "with --mesh decode_step",
    ),
) -> None:
    """Compile generation for TPUs or GPUs on this machine (no chip needed); print the compiler's numbers."""
    from dflax.aot import STAGES, StepShape, TpuCompilerUnavailableError, markdown_table, plan
    from dflax.aot.gpu import GpuCompilerUnavailableError
    from dflax.aot.sharded_plan import plan_sharded, sharded_table

    chosen = tuple(s.strip() for s in stages.split(",") if s.strip()) if stages else None
    try:
        shape = StepShape(batch, prompt_len, max_new_tokens, block_size)
        if mesh:
            with console.status(f"compiling {model} for {devices or 'the mesh of'} {platform} devices ..."):
                chip, shape, rows = plan_sharded(
                    model, mesh=mesh, platform=platform, devices=devices, topology=topology, card=card,
                    drafter=drafter, shape=shape, dtype=dtype, attention_backend=attention_backend,
                    stages=chosen or ("decode_step",),
                )  # fmt: skip
            console.print(f"{chip.name}, batch {shape.batch}, prompt bucket {shape.prompt_len}, budget "
                          f"{shape.max_new_tokens}, block {shape.block_size}")  # fmt: skip
            print(sharded_table(model, mesh, chip, rows))
            return
        topology = topology or "v5e:2x2"
        with console.status(f"compiling {model} for {topology} ..."):
            rows = plan(
                model,
                drafter=drafter,
                topology=topology,
                shape=shape,
                dtype=dtype,
                attention_backend=attention_backend,
                stages=chosen or STAGES,
            )
    except (TpuCompilerUnavailableError, GpuCompilerUnavailableError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    print(markdown_table(rows))
