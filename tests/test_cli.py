"""`dflax generate` end to end on a tiny checkpoint: JSONL in/out, chat and raw prompts, resume, errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflax.cli import app

runner = CliRunner()

PROMPTS = [
    {"id": "a", "prompt": "w5 w6 w7"},
    {"id": "b", "prompt": "w9 w10 w11 w12 w13 w14 w15 w16 w17"},
    {"id": 3, "messages": [{"role": "user", "content": "w20 w21"}]},
    {"id": "d", "prompt": "w30"},
    {"id": "e", "messages": [{"role": "system", "content": "w40"}, {"role": "user", "content": "w41 w42"}]},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_results(path):
    return {json.dumps(r["id"]): r for r in map(json.loads, path.read_text().splitlines())}


def run(target, *args):
    return runner.invoke(app, ["generate", "--target", str(target), "--max-new-tokens", "6", *args])


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.mark.parametrize("sampling", [[], ["--temperature", "1.0", "--seed", "7"]], ids=["greedy", "t1"])
def test_jsonl_raw_and_chat_then_resume(tmp_path, target_dir, sampling):
    """An interrupted run resumes: each prompt ends with exactly one line, the same one a full run writes
    (at T > 0 too: a prompt's seed follows its id, not its place among the prompts left to do)."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    write_jsonl(prompts, PROMPTS)
    args = ["--prompts", str(prompts), "--out", str(out), "--batch-size", "2", *sampling]
    result = run(target_dir, *args)
    assert result.exit_code == 0, result.output
    full = read_results(out)
    assert len(out.read_text().splitlines()) == len(PROMPTS)
    assert set(full) == {json.dumps(p["id"]) for p in PROMPTS}
    for r in full.values():
        assert 1 <= len(r["tokens"]) <= 6 and r["stats"]["new_tokens"] == len(r["tokens"])

    # An interrupted run: two lines done, the third torn mid-write.
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:15])
    result = run(target_dir, *args)
    assert result.exit_code == 0, result.output
    assert "2 of 5 prompts already done" in " ".join(result.output.split())
    good = [json.loads(x) for x in out.read_text().splitlines() if x.startswith("{") and x.endswith("}")]
    assert len(good) == len(PROMPTS), [r["id"] for r in good]  # lines, not dict entries: no duplicates
    resumed = {json.dumps(r["id"]): (r["text"], r["tokens"]) for r in good}
    assert resumed == {k: (r["text"], r["tokens"]) for k, r in full.items()}


def test_batch_output_equals_per_prompt_output(tmp_path, target_dir):
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, PROMPTS)
    outputs = {}
    for temperature in ("0", "1.0"):
        for batch in ("1", "4"):
            out = tmp_path / f"o{temperature}-{batch}.jsonl"
            result = run(
                target_dir,
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--batch-size",
                batch,
                "--temperature",
                temperature,
                "--seed",
                "7",
            )
            assert result.exit_code == 0, result.output
            outputs[temperature, batch] = {k: v["tokens"] for k, v in read_results(out).items()}
        assert outputs[temperature, "1"] == outputs[temperature, "4"]
    assert outputs["0", "1"] != outputs["1.0", "1"]


def test_malformed_lines_are_named_and_others_kept(tmp_path, target_dir):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text(
        json.dumps(PROMPTS[0])
        + "\n"
        + '{"id": "x", "prompt": "w5"\n'  # line 2: broken JSON
        + json.dumps(PROMPTS[1])
        + "\n"
        + json.dumps({"id": "y", "text": "w5"})
        + "\n"  # line 4: no prompt/messages
    )
    result = run(target_dir, "--prompts", str(prompts), "--out", str(out))
    assert result.exit_code == 2
    assert "line 2" in result.output and "line 4" in result.output
    assert set(read_results(out)) == {'"a"', '"b"'}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0", "w5"], "--max-new-tokens must be a positive integer"),
        (["--batch-size", "0", "w5"], "--batch-size must be a positive integer"),
        (["--method", "beam", "w5"], "unknown method 'beam'"),
        ([], "give prompts as arguments or with --prompts"),
    ],
)
def test_bad_arguments(args, message, target_dir):
    result = runner.invoke(app, ["generate", "--target", str(target_dir), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_unknown_target_lists_builtin_names():
    result = runner.invoke(app, ["generate", "--target", "llama-70b", "hello"])
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "unknown model 'llama-70b'" in output and "smollm2-135m" in output and "gemma3-270m" in output


def test_prompt_too_long_then_truncate(target_dir):
    long_prompt = " ".join(f"w{3 + i % 250}" for i in range(600))  # tiny context is 512 tokens
    result = run(target_dir, long_prompt)
    assert result.exit_code == 2
    assert "has 600 tokens" in " ".join(result.output.split())
    result = run(target_dir, "--truncate", long_prompt)
    assert result.exit_code == 0, result.output


def test_dflash_method_matches_ar(tmp_path, target_dir):
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, PROMPTS)
    outputs = {}
    for method in ("ar", "dflash"):
        out = tmp_path / f"{method}.jsonl"
        extra = ["--drafter", "untrained", "--block-size", "4"] if method == "dflash" else []
        result = run(target_dir, "--prompts", str(prompts), "--out", str(out), "--method", method, *extra)
        assert result.exit_code == 0, result.output
        outputs[method] = {k: v["tokens"] for k, v in read_results(out).items()}
    assert outputs["dflash"] == outputs["ar"]


def test_dflash_reports_tau_and_matches_plain_decoding(target_dir):
    plain = run(target_dir, "w5 w6")
    assert plain.exit_code == 0, plain.output
    assert "tau" not in plain.output
    spec = run(target_dir, "--method", "dflash", "--drafter", "untrained", "--block-size", "4", "w5 w6")
    assert spec.exit_code == 0, spec.output
    assert "tau 1." in spec.output
    assert plain.stdout.strip() and spec.stdout == plain.stdout  # the same text


def test_bench_plot_needs_something_to_draw(target_dir, tmp_path):
    args = ["bench", "--target", str(target_dir), "--method", "ar", "--plot", str(tmp_path / "b.png")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "add --method ...,dflash (or lookup) or --cost-curve" in " ".join(result.output.split())


def test_dflash_without_a_shipped_drafter(target_dir):
    result = run(target_dir, "--method", "dflash", "w5")
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "dflax ships no drafter for target" in output and "give a drafter directory" in output


def test_bench_runs_several_block_sizes_in_one_run(tmp_path, target_dir):
    prompts, report = tmp_path / "p.jsonl", tmp_path / "bench.json"
    write_jsonl(prompts, PROMPTS[:2])
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--method", "ar,dflash"]
    args += ["--drafter", "untrained", "--block-size", "2,4", "--max-new-tokens", "5", "--json", str(report)]
    result = runner.invoke(app, [*args, "--plot", str(tmp_path / "bench.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(report.read_text())
    assert data["block_sizes"] == [2, 4] and data["n_prompts"] == 2
    assert data["draft_sampling"] == {"mode": "greedy", "temperature": 1.0}  # auto at temperature 0
    assert data["dtype"] == "float32"  # the CPU default
    by_method = {r["method"]: r for r in data["results"]}
    assert set(by_method) == {"ar", "dflash-b2", "dflash-b4"}
    for r in by_method.values():
        assert r["lossless_match"] == 1.0 and r["new_tokens"] > 0 and r["tokens_per_s"] > 0
    assert by_method["ar"]["tau"] == 1.0
    assert sum(by_method["dflash-b4"]["accept_hist"]) > 0


def test_bench_chain_beside_trees_samples_its_drafts_at_temperature_1(tmp_path, target_dir):
    prompts, report = tmp_path / "p.jsonl", tmp_path / "bench.json"
    write_jsonl(prompts, PROMPTS[:1])
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--method", "dflash"]
    args += ["--drafter", "untrained", "--block-size", "4", "--tree-budget", "0,4", "--temperature", "1"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "4", "--json", str(report)])
    assert result.exit_code == 0, result.output
    by_method = {r["method"]: r for r in json.loads(report.read_text())["results"]}
    # The chain is what it would be alone (sampled drafts, block verification); trees need argmax drafts.
    assert by_method["dflash-t0"]["draft_sampling"] == "sample"
    assert by_method["dflash-t4"]["draft_sampling"] == "greedy"


def test_bench_rounds_report_the_median_round_and_round_by_round_speedups(tmp_path, target_dir):
    prompts, report = tmp_path / "p.jsonl", tmp_path / "bench.json"
    write_jsonl(prompts, PROMPTS[:2])
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--method", "ar,dflash"]
    args += ["--drafter", "untrained", "--block-size", "2", "--max-new-tokens", "5", "--json", str(report)]
    assert runner.invoke(app, [*args, "--rounds", "0"]).exit_code == 2
    result = runner.invoke(app, [*args, "--rounds", "3"])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["rounds_per_method"] == 3
    ar, dflash = data["results"]
    for r in (ar, dflash):
        assert len(r["round_tokens_per_s"]) == 3
        assert r["tokens_per_s"] == sorted(r["round_tokens_per_s"])[1]  # the median round
        assert r["lossless_match"] == 1.0
    assert dflash["speedup"] == pytest.approx(dflash["tokens_per_s"] / ar["tokens_per_s"])
    expected = [x / a for x, a in zip(dflash["round_tokens_per_s"], ar["round_tokens_per_s"])]
    assert dflash["round_speedups"] == pytest.approx(expected)


def test_lookup_and_dflash_trees_match_ar(tmp_path, target_dir):
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, PROMPTS)
    outputs = {}
    runs = {
        "ar": [],
        "lookup": ["--method", "lookup", "--block-size", "4"],
        "lookup-tree": ["--method", "lookup", "--block-size", "4", "--tree-budget", "9"],
        "lookup-always-verify": ["--method", "lookup", "--block-size", "4", "--min-match", "0"],
        "tree": ["--method", "dflash", "--drafter", "untrained", "--block-size", "4", "--tree-budget", "6"],
    }
    for name, extra in runs.items():
        out = tmp_path / f"{name}.jsonl"
        result = run(target_dir, "--prompts", str(prompts), "--out", str(out), *extra)
        assert result.exit_code == 0, result.output
        outputs[name] = {k: v["tokens"] for k, v in read_results(out).items()}
    for name in runs:
        assert outputs[name] == outputs["ar"], name


def test_tree_budget_needs_a_drafter(target_dir):
    result = run(target_dir, "--tree-budget", "8", "w5")
    assert result.exit_code == 2
    assert "--tree-budget needs --method dflash, dart or lookup" in " ".join(result.output.split())


def test_min_match_needs_lookup_and_a_value_it_can_match(target_dir):
    result = run(target_dir, "--min-match", "1", "w5")
    assert result.exit_code == 2 and "--min-match applies to --method lookup" in result.output
    result = run(target_dir, "--method", "lookup", "--min-match", "5", "w5")
    assert result.exit_code == 2 and "min_match must be 0 (always verify) .. 3" in result.output


def test_bench_runs_a_bfloat16_target(tmp_path, target_dir):
    prompts, report = tmp_path / "p.jsonl", tmp_path / "bench.json"
    write_jsonl(prompts, PROMPTS[:1])
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--method", "ar", "--dtype"]
    result = runner.invoke(app, [*args, "bfloat16", "--max-new-tokens", "3", "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["dtype"] == "bfloat16" and data["results"][0]["new_tokens"] > 0


def test_an_unknown_draft_sampling_mode_is_one_clear_error(target_dir):
    result = run(
        target_dir, "--method", "dflash", "--drafter", "untrained", "--draft-sampling", "ratio", "w5"
    )
    assert result.exit_code == 2 and "--draft-sampling 'ratio': use auto, greedy or sample" in result.output


def test_dart_generates_like_ar_and_benches_under_its_name(tmp_path, target_dir):
    prompts, report = tmp_path / "p.jsonl", tmp_path / "bench.json"
    write_jsonl(prompts, PROMPTS[:2])
    outputs = {}
    for name, extra in {
        "ar": [],
        "dart": ["--method", "dart", "--drafter", "untrained", "--tree-budget", "8"],
    }.items():
        out = tmp_path / f"{name}.jsonl"
        result = run(
            target_dir, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6", *extra
        )
        assert result.exit_code == 0, result.output
        outputs[name] = {k: v["tokens"] for k, v in read_results(out).items()}
    assert outputs["dart"] == outputs["ar"]
    result = run(target_dir, "--method", "dart", "w5")
    assert result.exit_code == 2 and "--method dart needs --drafter" in " ".join(result.output.split())
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--method", "ar,dart"]
    args += ["--drafter", "untrained", "--tree-budget", "0,8", "--max-new-tokens", "5", "--json", str(report)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    by_method = {r["method"]: r for r in data["results"]}
    assert set(by_method) == {"ar", "dart-t0", "dart-t8"} and data["dart_drafter"] == "untrained"
    assert [by_method[m]["tree_budget"] for m in ("dart-t0", "dart-t8")] == [0, 8]
    assert all(r["lossless_match"] == 1.0 for r in by_method.values())


def test_bench_runs_lookup_at_several_tree_budgets(tmp_path, target_dir):
    prompts, report = tmp_path / "p.jsonl", tmp_path / "bench.json"
    write_jsonl(prompts, PROMPTS[:2])
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--method", "ar,lookup"]
    args += ["--block-size", "4", "--tree-budget", "0,6", "--max-new-tokens", "5", "--json", str(report)]
    result = runner.invoke(app, [*args, "--min-match", "0"])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["tree_budgets"] == [0, 6]
    by_method = {r["method"]: r for r in data["results"]}
    assert set(by_method) == {"ar", "lookup-t0", "lookup-t6"}
    assert [by_method[m]["tree_budget"] for m in ("ar", "lookup-t0", "lookup-t6")] == [None, 0, 6]
    for r in by_method.values():
        assert r["lossless_match"] == 1.0 and r["new_tokens"] > 0
    assert len(by_method["lookup-t6"]["accept_hist"]) == 6 + 2  # tokens committed per step: 0 .. N + 1
    assert by_method["lookup-t0"]["min_match"] == by_method["lookup-t6"]["min_match"] == 0


def test_bench_compares_continuous_batching_with_static_batches(tmp_path, target_dir):
    prompts, report = tmp_path / "p.jsonl", tmp_path / "bench.json"
    write_jsonl(prompts, PROMPTS)
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--method", "ar"]
    args += ["--batch-size", "2", "--refill-every", "0,3", "--max-new-tokens", "7", "--json", str(report)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    by_method = {r["method"]: r for r in data["results"]}
    assert set(by_method) == {"ar", "ar-refill3"} and data["refill_every"] == [0, 3]
    refilled = by_method["ar-refill3"]
    assert refilled["refill_every"] == 3 and refilled["refills"] >= 2  # more prompts than rows
    assert refilled["lossless_match"] == 1.0 and refilled["new_tokens"] == by_method["ar"]["new_tokens"]
    assert refilled["wall_tokens_per_s"] > 0 and refilled["speedup"] > 0


def test_bench_refill_needs_a_fixed_block_size(target_dir):
    args = ["bench", "--target", str(target_dir), "--method", "hf", "--refill-every", "8"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "--refill-every applies to dflax's methods" in " ".join(result.output.split())


def test_three_shards_union_equals_unsharded_run(tmp_path, target_dir):
    """K=3 shards, each in its own process-like run and file: every id lands in exactly one shard, and the
    union of the shard files is the unsharded output (at T > 0: seeds follow ids, not shards)."""
    prompts = tmp_path / "p.jsonl"
    rows = PROMPTS + [{"id": f"x{i}", "prompt": f"w{50 + i} w{60 + i}"} for i in range(7)]
    write_jsonl(prompts, rows)
    sampling = ["--temperature", "1.0", "--seed", "3", "--batch-size", "2"]
    whole = tmp_path / "whole.jsonl"
    assert run(target_dir, "--prompts", str(prompts), "--out", str(whole), *sampling).exit_code == 0
    lines = []
    for i in range(3):
        out = tmp_path / f"shard{i}.jsonl"
        args = ["--prompts", str(prompts), "--out", str(out), "--num-shards", "3", "--shard-index", str(i)]
        result = run(target_dir, *args, *sampling)
        assert result.exit_code == 0, result.output
        lines += [json.loads(x) for x in out.read_text().splitlines()]
        assert 0 < len(out.read_text().splitlines()) < len(rows)  # 12 ids do not all hash to one shard
    ids = [json.dumps(r["id"]) for r in lines]
    assert sorted(ids) == sorted(json.dumps(r["id"]) for r in rows)  # every id exactly once
    expected = {k: r["tokens"] for k, r in read_results(whole).items()}
    assert {json.dumps(r["id"]): r["tokens"] for r in lines} == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-shards", "3", "--shard-index", "3"], "--shard-index must be in 0..2"),
        (["--num-shards", "0"], "--num-shards must be a positive integer"),
    ],
)
def test_bad_shard_arguments(tmp_path, target_dir, args, message):
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, PROMPTS)
    result = run(target_dir, "--prompts", str(prompts), *args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_cost_curve_sizes_must_include_one_token():
    from dflax.planning.cost_curve import measure_cost_curve

    with pytest.raises(ValueError, match="include 1"):
        measure_cost_curve(None, sizes=(2, 4))
