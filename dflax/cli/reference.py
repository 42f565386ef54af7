"""`dflax check-reference`: dflax against the reference DFlash on one drafter."""

from __future__ import annotations

import typer

from dflax.checkpoints.registry import DEFAULT_TARGET
from dflax.cli.app import app
from dflax.cli.common import console, fail, load_target_or_fail


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
            fail(f"{prompts}: malformed lines: " + "; ".join(map(str, bad)))
        loaded = load_target_or_fail(target, "float32")
        spec = load_drafter(drafter, loaded)
        ids = [encode_prompt(loaded, r.prompt) for r in records[:limit]]
        agreements = compare(loaded, spec, ids, max_new_tokens)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        fail(str(e))
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
