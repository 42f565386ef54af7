"""`--num-samples`, `--shared-prefix` and `--system-prompt` end to end on a tiny checkpoint.

Each of N samples equals what its own seed gives for the prompt alone (unshared); the bench runs a method
with and without shared prefixes in one run, token-identical, the common prefix stored once per batch.
"""

from __future__ import annotations

import json

import pytest
from test_cli import read_results, run, runner, write_jsonl

import dflax
from dflax.cli import app
from dflax.prompts import row_seed

LONG = " ".join(f"w{i}" for i in range(5, 45))  # 40 words, one token each
PROMPTS = [{"id": "p", "prompt": LONG + " w50 w51"}, {"id": 7, "prompt": "w60 w61 " + LONG}]


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


def test_num_samples_each_equal_to_its_seed_alone(tmp_path, target_dir):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    write_jsonl(prompts, PROMPTS)
    args = ["--prompts", str(prompts), "--out", str(out), "--num-samples", "3", "--temperature", "1.0"]
    result = run(target_dir, *args, "--seed", "5", "--shared-prefix", "auto", "--batch-size", "8")
    assert result.exit_code == 0, result.output
    got = read_results(out)
    ids = [[p["id"], k] for p in PROMPTS for k in range(3)]
    assert set(got) == {json.dumps(i) for i in ids}
    target = dflax.load_target(str(target_dir))
    for p in PROMPTS:
        samples = [got[json.dumps([p["id"], k])] for k in range(3)]
        assert len({tuple(s["tokens"]) for s in samples}) > 1  # different samples of one prompt
        for k, sample in enumerate(samples):
            assert sample["stats"]["shared_prefix_tokens"] == 41  # the prompt less its last token
            alone = dflax.generate(
                target,
                [p["prompt"]],
                max_new_tokens=6,
                temperature=1.0,
                row_seeds=[row_seed(5, [p["id"], k])],
            )[0]
            assert sample["tokens"] == alone.tokens


def test_num_samples_needs_a_temperature(target_dir):
    result = run(target_dir, "--num-samples", "2", "w5")
    assert result.exit_code == 2
    assert "give --temperature > 0" in " ".join(result.output.split())


def test_bench_with_and_without_shared_prefix(tmp_path, target_dir):
    prompts, system, report = tmp_path / "p.jsonl", tmp_path / "system.txt", tmp_path / "bench.json"
    write_jsonl(prompts, [{"id": i, "prompt": f"w{50 + i} w{60 + i}"} for i in range(4)])
    system.write_text(LONG)
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--method", "ar"]
    args += ["--batch-size", "4", "--max-new-tokens", "5", "--json", str(report)]
    result = runner.invoke(app, [*args, "--shared-prefix", "none,auto", "--system-prompt", str(system)])
    assert result.exit_code == 0, result.output
    by_method = {r["method"]: r for r in json.loads(report.read_text())["results"]}
    assert set(by_method) == {"ar", "ar-shared"}
    shared, plain = by_method["ar-shared"], by_method["ar"]
    assert shared["lossless_match"] == 1.0
    assert plain["prefix_kv_bytes"] == 4 * shared["prefix_kv_bytes"] > 0  # 4 rows, one stored copy
    assert shared["kv_cache_bytes"] < plain["kv_cache_bytes"]
    result = runner.invoke(app, [*args, "--shared-prefix", "sometimes"])
    assert result.exit_code == 2 and "give none, auto or none,auto" in " ".join(result.output.split())
