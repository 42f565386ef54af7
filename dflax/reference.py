"""dflax against the reference DFlash (PyPI `dflash`) on one drafter: the same tokens, step by step.

`run_reference` decodes prompts with the reference loop in a child process (`dflax.reference_baseline`);
`step_commits` decodes one prompt with dflax's decode step, one jitted step at a time, and records how many
tokens each step committed; `compare` puts the two side by side (greedy, batch 1), which is what
`dflax check-reference` prints and tests/drafters/test_reference_loop.py asserts.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflax.checkpoints.registry import resolve
from dflax.decoding.decode import decode_step, prefill
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import Drafter
from dflax.drafters.checkpoint import load_drafter_checkpoint
from dflax.drafters.official import official_format_problems
from dflax.models.cache import KVCache
from dflax.runtime.shapes import cache_slots, prompt_bucket
from dflax.target import Target


def check_reference_installed() -> None:
    """Raises ImportError with the install command when torch or the reference package is missing."""
    missing = [name for name in ("torch", "dflash") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"the reference DFlash needs {' and '.join(missing)}: pip install torch==2.13.0 accelerate; "
            "pip install --no-deps dflash==0.1.0 (or bash .ci/setup --test)"
        )


def official_drafter_dir(path: str | Path) -> Path:
    """`path` when it holds a drafter the reference can run, else ValueError naming what does not fit."""
    path = Path(path)
    config, _, draft_vocab = load_drafter_checkpoint(path, jnp.float32)
    problems = official_format_problems(config, draft_vocab is not None)
    if problems:
        raise ValueError(
            f"the reference cannot run the drafter at {path}: " + "; ".join(problems)
            + ". Use a drafter in the official format, e.g. --drafter smollm2-135m-official"
        )
    return path


def run_reference(
    target: Target,
    drafter_dir: str | Path,
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
) -> list[dict]:
    """The reference's `dflash_generate` on each prompt, in a child process (see dflax.reference_baseline).

    Returns:
      Per prompt: tokens (EOS included), commits (tokens added per step), prefill_s, decode_s.
    """
    check_reference_installed()
    kind, path = resolve(target.name)
    request = {
        "kind": kind,
        "path": str(path),
        "drafter": str(official_drafter_dir(drafter_dir)),
        "prompts": [list(map(int, ids)) for ids in prompt_ids],
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "eos_ids": list(target.eos_ids),
        "seed": seed,
    }
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        done = subprocess.run(
            [sys.executable, "-m", "dflax.reference_baseline", str(req), str(res)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"the reference DFlash failed:\n{done.stderr[-3000:]}")
        return json.loads(res.read_text())


@functools.lru_cache(maxsize=8)
def _programs(target: Target, drafter: Drafter):
    proposer = drafter.proposer
    prefill_fn = jax.jit(
        functools.partial(prefill, target.module, proposer=proposer), static_argnames=("max_tokens",)
    )
    step_fn = jax.jit(functools.partial(decode_step, target.module, proposer=proposer))
    return prefill_fn, step_fn


def step_commits(
    target: Target, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """Greedy decoding of one prompt with dflax, one decode step at a time.

    Returns:
      (tokens, commits): the new tokens (EOS included) and how many each verify step added (the first
      token, sampled after the prefill, belongs to no step), as the reference counts its acceptance lengths.
    """
    prefill_fn, step_fn = _programs(target, drafter)
    bucket = prompt_bucket(len(prompt_ids))
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, : len(prompt_ids)] = prompt_ids
    sampling = SamplingParams.make()
    slots = cache_slots(bucket, max_new_tokens, drafter.proposer)
    cache = KVCache.init(target.config, 1, slots, target.cache_dtype)
    state = prefill_fn(
        target.params,
        jnp.asarray(tokens),
        jnp.asarray([len(prompt_ids)], jnp.int32),
        cache,
        jnp.asarray([max_new_tokens], jnp.int32),
        jax.vmap(jax.random.key)(jnp.zeros((1,), jnp.uint32)),
        jnp.asarray(target.eos_ids, jnp.int32),
        sampling,
        drafter.params,
        max_tokens=max_new_tokens,
    )
    commits, generated = [], int(state.num_generated[0])
    while not bool(state.done[0]):
        state = step_fn(target.params, state, sampling, drafter.params)
        now = int(state.num_generated[0])
        commits.append(now - generated)
        generated = now
    return np.asarray(state.tokens[0, :generated]).tolist(), commits


@dataclasses.dataclass(frozen=True)
class Agreement:
    """dflax and the reference on one prompt (greedy, batch 1).

    Attributes:
      same_tokens: the new tokens are identical.
      same_commits: every compared step committed as many tokens in both.
      compared_steps: the steps compared: those where the reference drafted a whole block. Within the
        last B tokens of the budget it drafts a shorter block (bidirectional attention over fewer
        positions drafts other tokens), where dflax keeps its static block and stops at the budget.
      first_token_difference: index of the first differing new token (None when identical).
      first_step_difference: index of the first compared step whose commits differ (None when all agree).
      dflax_tau, reference_tau: tokens per verify step, every step counted.
    """

    same_tokens: bool
    same_commits: bool
    compared_steps: int
    first_token_difference: int | None
    first_step_difference: int | None
    dflax_tau: float
    reference_tau: float


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def full_block_steps(commits: list[int], max_new_tokens: int, block_size: int) -> int:
    """How many of the reference's first steps drafted a whole block: step k verifies
    min(B, max_new_tokens + 1 - g_k) tokens, g_k = tokens generated before it (the first one included)."""
    generated = 1
    for k, c in enumerate(commits):
        if max_new_tokens + 1 - generated < block_size:
            return k
        generated += c
    return len(commits)


def compare(
    target: Target, drafter: Drafter, prompt_ids: Sequence[list[int]], max_new_tokens: int
) -> list[Agreement]:
    """Greedy decoding of every prompt by dflax and by the reference with the same official-format drafter.

    `drafter` must be loaded from a directory (its `name`) in the official format, at its trained block
    size, with greedy drafts.
    """
    theirs = run_reference(target, drafter.name, prompt_ids, max_new_tokens, temperature=0.0)
    out = []
    for ids, ref in zip(prompt_ids, theirs):
        tokens, commits = step_commits(target, drafter, list(ids), max_new_tokens)
        full = full_block_steps(ref["commits"], max_new_tokens, drafter.proposer.block_size)
        token_diff = _first_difference(tokens, ref["tokens"])
        step_diff = _first_difference(commits[:full], ref["commits"][:full])
        out.append(
            Agreement(
                same_tokens=token_diff is None,
                same_commits=step_diff is None,
                compared_steps=full,
                first_token_difference=token_diff,
                first_step_difference=step_diff,
                dflax_tau=sum(commits) / max(len(commits), 1),
                reference_tau=sum(ref["commits"]) / max(len(ref["commits"]), 1),
            )
        )
    return out


def bench_runner(
    target: Target, prompt_ids, max_new_tokens, temperature, batch_size, seed, progress, *, drafter
):
    """`dflax bench --method official`: the reference's loop on every prompt, in the bench's row format.

    Args:
      drafter: the official-format drafter directory both dflax's dflash rows and the reference run.

    Returns:
      (tokens per prompt, one per-batch record per prompt: the reference decodes one prompt at a time).

    Raises:
      ValueError: at a batch size above 1, or for a drafter the reference cannot run.
    """
    if batch_size != 1:
        raise ValueError(
            f"the reference DFlash decodes one prompt at a time: run --method official at --batch-size 1, "
            f"not {batch_size}"
        )
    outputs = run_reference(target, drafter, prompt_ids, max_new_tokens, temperature, seed)
    per_batch = []
    for ids, out in zip(prompt_ids, outputs):
        hist = np.bincount(out["commits"], minlength=2).tolist() if out["commits"] else [0, 0]
        per_batch.append(
            {
                "rows": 1,
                "prompt_tokens": len(ids),
                "prefill_s": out["prefill_s"],
                "decode_s": out["decode_s"],
                "decode_tokens": len(out["tokens"]) - 1,
                "steps": len(out["commits"]),
                "committed": sum(out["commits"]),
                "reference_accept_hist": hist,
            }
        )
        progress(1)
    return [out["tokens"] for out in outputs], per_batch
