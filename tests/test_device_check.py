"""tools/device_check.py: its --dry-run (tiny sizes on the CPU) writes every section with sane values, and a
stage that overruns its budget is killed and recorded while the run goes on."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "device_check.py"
sys.path.insert(0, str(TOOL.parent))

import device_check  # noqa: E402


def run_tool(out: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(TOOL), "--out", str(out), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def strict_json(path: Path) -> dict:
    """The file as JSON, refusing NaN and infinities (which strict JSON readers reject)."""

    def refuse(name):
        raise ValueError(f"{path} holds {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("device_check") / "device_check.json"
    proc = run_tool(out, "--dry-run", "--chip", "h100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return strict_json(out)


def test_dry_run_records_device_versions_and_every_stage_within_budget(report):
    assert report["schema"] == device_check.SCHEMA and report["dry_run"] is True
    assert report["device_kind"] == "cpu" and report["backend"] == "cpu"
    assert report["jax"].count(".") >= 2
    assert list(report["stages"]) == list(device_check.STAGES)
    for name, stage in report["stages"].items():
        assert stage["status"] == "ok", (name, stage.get("log_tail"))
        assert 0 < stage["elapsed_s"] <= stage["budget_s"], name
    assert report["total_s"] >= sum(s["elapsed_s"] for s in report["stages"].values())
    env = report["stages"]["env"]
    assert env["device_count"] >= 1 and env["chip"]["key"] == "h100" and env["chip"]["forced_by_flag"]


def test_dry_run_kernels_match_their_references_in_interpret_mode(report):
    kernels = report["stages"]["kernels"]
    assert kernels["interpret"] is True and kernels["platform"] == "gpu"
    assert {c["op"] for c in kernels["cases"]} == {"tree_attention", "shared_prefix_attention"}
    assert kernels["failed"] == 0 and kernels["passed"] == len(kernels["cases"])
    for case in kernels["cases"]:
        assert case["passed"] and case["nonfinite"] == 0, case
        assert 0 <= case["max_abs_err"] <= case["atol"] + case["rtol"] * 10, case
        assert case["kernel_ms"] > 0


def test_dry_run_greedy_compares_device_and_cpu_tokens(report):
    greedy = report["stages"]["greedy"]
    assert greedy["device_dtype"] == "bfloat16" and greedy["reference"].startswith("CPU float32")
    assert greedy["n_prompts"] == len(greedy["prompts"]) == 2
    assert greedy["identical"] == sum(p["identical"] for p in greedy["prompts"])
    for p in greedy["prompts"]:
        assert 1 <= len(p["device_tokens"]) <= 4 and 1 <= len(p["cpu_tokens"]) <= 4
        assert p["identical"] == (p["device_tokens"] == p["cpu_tokens"])
        assert p["min_top2_gap"] >= 0 and 0 <= p["min_top2_gap_position"] < len(p["cpu_tokens"])
        if p["identical"]:
            assert p["first_difference"] is None and p["top2_gap"] is None
        else:
            assert p["first_difference"] >= 0 and p["top2_gap"] >= 0


def test_dry_run_bench_keeps_run_bench_rows(report):
    bench = report["stages"]["bench"]
    assert bench["prompts"]["source"] == "inline" and len(bench["prompts"]["ids"]) == 2
    assert list(bench["runs"]) == ["2"]
    rows = {row["method"]: row for row in bench["rows"]}
    assert set(rows) == {"ar", "dflash"}
    for row in rows.values():
        assert row["batch_size"] == 2 and row["tokens_per_s"] > 0 and row["decode_tokens"] > 0
    assert rows["dflash"]["block_size"] == 3 and 0 <= rows["dflash"]["lossless_match"] <= 1
    assert rows["dflash"]["speedup"] > 0


def test_dry_run_steps_are_timed_next_to_the_roofline(report):
    steps = report["stages"]["steps"]
    assert steps["random_weights"] and steps["layers_timed"] == steps["layers_full"] == 2
    assert steps["chip"]["key"] == "h100"
    tokens = {name: s["tokens"] for name, s in steps["steps"].items()}
    assert tokens == {"plain_1": 1, "verify_16": 16, "tree_32": 33}
    for s in steps["steps"].values():
        assert s["median_s"] > 0 and s["weight_bytes"] > 0 and s["kv_bytes"] > 0
        assert math.isclose(s["roofline_s"], max(s["memory_s"], s["compute_s"]))
        assert math.isclose(s["measured_over_roofline"], s["median_s"] / s["roofline_s"])
    flops = [steps["steps"][n]["flops"] for n in ("plain_1", "verify_16", "tree_32")]
    assert flops == sorted(flops) and flops[0] < flops[1]


def test_summary_row_has_a_cell_per_column(report):
    header, row = device_check.SUMMARY_HEADER.splitlines()[0], device_check.summary_row(report)
    assert row.count("|") == header.count("|")
    assert row.startswith("| cpu | ") and "| 2/2 | 2/2 | 2: " in row


def test_an_overrunning_stage_is_killed_recorded_and_the_budget_skips_the_rest(tmp_path):
    out = tmp_path / "device_check.json"
    # Two interpret-mode kernel cases take several seconds; 2 s leaves the next stage under a second.
    budgets = ["--budget-s", "2.8", "--budgets", "kernels=2"]
    proc = run_tool(out, "--dry-run", "--stages", "kernels,steps", *budgets)
    assert proc.returncode == 1
    stages = strict_json(out)["stages"]
    assert stages["kernels"]["status"] == "timeout" and stages["kernels"]["process"] == "kernels"
    assert 2 <= stages["kernels"]["elapsed_s"] < 10
    assert stages["steps"]["status"] == "skipped"


def test_bad_budgets_and_chips_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown stage 'kernel'"):
        device_check.parse_budgets("kernel=30")
    with pytest.raises(ValueError, match="needs seconds"):
        device_check.parse_budgets("bench=soon")
    assert device_check.parse_budgets("bench=200")["bench"] == 200
    with pytest.raises(ValueError, match="--chip 'h300' unknown"):
        device_check.chip_record("cpu", "h300")
    assert device_check.chip_record("NVIDIA H100 80GB HBM3", None)["key"] == "h100"
    assert device_check.chip_record("NVIDIA H200", None)["key"] == "h200"
    assert device_check.chip_record("TPU v5 lite", None)["key"] == "v5e"
    assert device_check.chip_record("cpu", None)["key"] is None
