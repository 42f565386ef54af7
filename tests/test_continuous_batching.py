"""Continuous batching: refilled rows give exactly what one-prompt-at-a-time generation gives, and an
interrupted `dflax generate` (kill -9) resumes to one line per id."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import dflax
from dflax.cli import app
from dflax.runtime.continuous import MIN_REFILL_ROWS, refill_rows

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.fixture(scope="module")
def ragged_target(target_dir):
    """The tiny target with 24 of its 256 tokens ending a row, so rows end at scattered lengths (a random
    tiny model almost never emits its one real EOS) and finished rows get refilled mid-batch."""
    target = dflax.load_target(str(target_dir))
    eos = tuple(range(40, 64))
    return dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=eos))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [" ".join(f"w{t}" for t in rng.integers(3, 200, rng.integers(1, 40))) for _ in range(13)]


@pytest.mark.parametrize("batch_size", [4, 8])  # 8: refills of a few rows prefill 4 (padding dropped)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_refilled_batches_equal_one_prompt_at_a_time(ragged_target, prompts, temperature, batch_size):
    settings = dict(max_new_tokens=24, temperature=temperature, seed=5)
    alone = [
        dflax.generate(ragged_target, [p], batch_size=1, row_seeds=[5 + i], **settings)[0]
        for i, p in enumerate(prompts)
    ]
    order = []
    refilled = dflax.generate(
        ragged_target,
        prompts,
        batch_size=batch_size,
        refill_every=3,
        on_result=lambda i, r: order.append(i),
        **settings,
    )
    lengths = [len(r.tokens) for r in alone]
    assert len(set(lengths)) > 3 and min(lengths) < 24, lengths  # ragged: rows finish at different steps
    assert order != sorted(order) and sorted(order) == list(range(len(prompts)))  # refilled out of order
    assert [r.tokens for r in refilled] == [r.tokens for r in alone]
    assert [r.stats["finish_reason"] for r in refilled] == [r.stats["finish_reason"] for r in alone]
    assert [r.stats["steps"] for r in refilled] == [r.stats["steps"] for r in alone]


def test_refilled_speculative_batches_keep_the_drafter_state_per_row(ragged_target, prompts):
    """DFlash rows joining mid-batch start from their own drafter context (merged with the cache)."""
    drafter = dflax.load_drafter("untrained", ragged_target, block_size=4)
    plain = dflax.generate(ragged_target, prompts, max_new_tokens=24, batch_size=1)
    spec = dflax.generate(
        ragged_target, prompts, max_new_tokens=24, batch_size=8, refill_every=2, drafter=drafter
    )
    alone = [
        dflax.generate(ragged_target, [p], max_new_tokens=24, batch_size=1, drafter=drafter)[0]
        for p in prompts
    ]
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert [r.stats["accept_hist"] for r in spec] == [r.stats["accept_hist"] for r in alone]


def test_refills_prefill_a_power_of_two_rows_at_least_four():
    sizes = [refill_rows(joining, rows) for joining, rows in ((1, 64), (4, 64), (5, 64), (33, 64), (3, 2))]
    assert sizes == [MIN_REFILL_ROWS, 4, 8, 64, 2]


def test_refill_every_must_be_positive(ragged_target):
    with pytest.raises(ValueError, match="refill_every must be a positive number"):
        dflax.generate(ragged_target, ["w5"], refill_every=0)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{") and x.endswith("}")]


def test_rerun_after_kill_9_writes_every_id_exactly_once(target_dir, tmp_path):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    rng = np.random.default_rng(2)
    rows = [{"id": i, "prompt": " ".join(f"w{t}" for t in rng.integers(3, 200, 5))} for i in range(48)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["generate", "--target", str(target_dir), "--prompts", str(prompts), "--max-new-tokens", "48"]
    args += ["--batch-size", "4", "--refill-every", "2", "--temperature", "1.0", "--seed", "9"]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-m", "dflax", *args, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and child.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    killed_with = len(_lines(out))
    assert 3 <= killed_with < len(rows), f"{killed_with} lines when killed: kill it earlier or give more work"

    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    ids = [r["id"] for r in _lines(out)]
    assert sorted(ids) == list(range(len(rows)))  # every id exactly once

    fresh = tmp_path / "fresh.jsonl"
    result = CliRunner().invoke(app, [*args, "--refill-every", "0", "--out", str(fresh)])  # static batches
    assert result.exit_code == 0, result.output
    assert {r["id"]: r["tokens"] for r in _lines(out)} == {r["id"]: r["tokens"] for r in _lines(fresh)}
