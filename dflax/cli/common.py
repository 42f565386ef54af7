"""What every `dflax` command shares: the console, one clear error, option help, loading a target."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console

# Messages are not wrapped at the console width: paths and error lines stay whole in logs and pipes.
console = Console(stderr=True, soft_wrap=True)

TARGET_HELP = "built-in name (smollm2-135m, gemma3-270m), a .gguf file or an HF checkpoint directory"
METHODS = ("ar", "dflash", "dart", "lookup", "diffuspec")
DRAFTER_HELP = (
    "DFlash drafter directory (official z-lab/dflash layout) or, with --method dart, a DART drafter "
    "directory, or with --method diffuspec, a masked diffusion LM directory; 'untrained' (random, for "
    "tests); default (dflash): the drafter dflax ships for the target"
)


def fail(message: str) -> None:
    """Prints `message` as the command's one error and exits with status 2."""
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def check_method(method: str) -> None:
    """One clear error for an unknown --method."""
    if method not in METHODS:
        fail(f"unknown method {method!r}; available: {', '.join(METHODS)}")


DRAFT_SAMPLING_HELP = (
    "dflash: greedy (argmax drafts, delta rule), sample (drafts drawn from the drafter's q, block "
    "verification) or auto: greedy at --temperature 0 and with a draft tree, sample otherwise"
)
MIN_MATCH_HELP = (
    "lookup: verify drafts only in steps where some row's last N tokens (0..3) occurred before, else take a "
    "plain one-token step; 0 = always verify (default 2)"
)
WINDOW_HELP = (
    "diffuspec: auto (adaptive draft length k in [20, 30], a window of 30 verified per step), MIN:MAX "
    "(adaptive k in those bounds) or K (a fixed k); default auto"
)
REFINE_HELP = "diffuspec: diffusion forwards per draft (1 as published)"
CPS_HELP = "diffuspec: causal-consistency path search over the lattice (--no-cps: each slot's argmax)"


def check_diffuspec_options(methods, window: str | None, refine_steps: int, cps) -> None:
    """--window, --refine-steps and --cps only with --method diffuspec."""
    if "diffuspec" not in methods and (window is not None or refine_steps != 1 or cps not in (True, "on")):
        fail("the --window, --refine-steps and --cps options apply to --method diffuspec")


def check_lookup_options(methods, min_match: int | None) -> None:
    """--min-match only with --method lookup."""
    if min_match is not None and "lookup" not in methods:
        fail("--min-match applies to --method lookup")


def block_size_value(text: str) -> int | str:
    """A --block-size value: an integer >= 2 or "auto"; anything else is one clear error."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2:
        fail(f"--block-size {text!r}: give auto or an integer >= 2 (the anchor plus drafts), e.g. 16 or 8,16")
    return value


def read_recipe(cls, path: Path, label: str, **overrides):
    """A recipe dataclass from its JSON file (with field overrides), or one clear error naming `label`."""
    import dataclasses

    if not path.is_file():
        fail(f"{label}: no such file")
    try:
        return dataclasses.replace(cls.from_json(path), **overrides)
    except (ValueError, TypeError) as e:
        fail(f"{label}: {e}")


MESH_HELP = (
    "shard over a device mesh, data=D,model=M: batch rows split D ways (a batch is padded to a multiple of "
    "D), heads, FFN and vocabulary M ways (tensor parallel); the tokens equal a one-device run"
)


def load_target_or_fail(target: str, dtype: str | None, mesh: str | None = None):
    """The target, loaded with a status line and its load time, or one clear error."""
    from dflax.paths import enable_compilation_cache
    from dflax.target import load_target

    # Compiled decode steps persist across runs: a shape compiles once per machine, not once per command.
    enable_compilation_cache()

    with console.status(f"loading {target} ..."):
        t0 = time.perf_counter()
        try:
            loaded = load_target(target, dtype=dtype, mesh=mesh)
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
    on = f" on mesh {mesh}" if mesh else ""
    console.print(
        f"loaded {target} ({loaded.config.arch}, {loaded.dtype.__name__}){on} in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return loaded


SHARED_PREFIX_HELP = (
    "auto: a token prefix common to consecutive prompts of a batch (a system message, one prompt's "
    "samples) is prefilled and stored once per group of rows, and runs static batches; none: every row "
    "holds its whole prompt. Outputs are the same"
)
SYSTEM_PROMPT_HELP = "text file: a system message put in front of every prompt (prompts become chats)"


def read_system_prompt(path: Path) -> str:
    """The text of a --system-prompt file."""
    if not path.is_file():
        fail(f"--system-prompt {path}: no such file")
    return path.read_text(encoding="utf-8")
