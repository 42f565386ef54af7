"""dflax.plots draws what a real bench report holds: one bar per histogram bin, one line per series; the
report itself names the machine it measured."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from dflax import plots
from dflax.bench import run_bench
from dflax.planning import roofline

COST_SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def report(tiny_checkpoint, tmp_path_factory):
    """A real bench report (tiny target, untrained drafter at B=2 and 4, batch 1 and 2, cost curve),
    round-tripped through JSON as `--json` writes it."""
    prompts = tmp_path_factory.mktemp("plots") / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": i, "prompt": f"w{5 + i} w{9 + i} w7"}) + "\n" for i in range(3))
    )
    result = run_bench(
        prompts=str(prompts),
        target=str(tiny_checkpoint("llama")[0]),
        methods=["ar", "dflash"],
        limit=2,
        max_new_tokens=4,
        temperature=0.0,
        batch_size=[1, 2],
        seed=0,
        drafter="untrained",
        block_sizes=[2, 4],
        cost_curve=True,
        cost_curve_sizes=COST_SIZES,
    )
    return json.loads(json.dumps(result))


def _bar_heights(ax):
    return [p.get_height() for p in ax.patches]


def test_accepted_length_histogram_has_one_bar_per_bin_of_each_speculative_result(report):
    ax = plots.plot_accepted_lengths(report)
    spec = plots.speculative_results(report)
    assert [r["method"] for r in spec] == ["dflash-b2", "dflash-b4"] * 2  # ar has no draft bins
    bins = [len(r["accept_hist"]) - 1 for r in spec]  # 1 .. B committed tokens per step
    assert bins == [2, 4, 2, 4]
    heights = _bar_heights(ax)
    assert len(heights) == sum(bins)
    start = 0
    for r, n in zip(spec, bins):  # each series: the fraction of that result's steps
        hist = np.asarray(r["accept_hist"][1:], float)
        np.testing.assert_allclose(heights[start : start + n], hist / hist.sum())
        start += n


def test_tau_and_speedup_draw_one_line_per_batch_size_over_block_sizes(report):
    tau_ax, speed_ax = plots.plot_tau_and_speedup(report)
    assert len(tau_ax.lines) == 2  # batch 1 and batch 2
    for line, batch in zip(tau_ax.lines, (1, 2)):
        expected = [r["tau"] for r in report["results"] if r["batch_size"] == batch and r["method"] != "ar"]
        assert list(line.get_xdata()) == [2, 4]
        np.testing.assert_allclose(line.get_ydata(), expected)
    data_lines = [line for line in speed_ax.lines if line.get_gid() != "plain-decoding"]
    assert len(data_lines) == 2 and len(speed_ax.lines) == 3  # plus the 1x reference
    speedups = [r["speedup"] for r in report["results"] if r["batch_size"] == 1 and r["method"] != "ar"]
    np.testing.assert_allclose(data_lines[0].get_ydata(), speedups)


def test_results_with_a_tree_budget_get_a_line_per_budget(report):
    with_trees = copy.deepcopy(report)
    for budget in (16, 32):
        for r in report["results"]:
            if r["method"] != "ar":
                with_trees["results"].append({**copy.deepcopy(r), "tree_budget": budget})
    tau_ax, _ = plots.plot_tau_and_speedup(with_trees)
    labels = [line.get_label() for line in tau_ax.lines]
    assert len(labels) == 6  # (batch 1, 2) x (no tree, budget 16, budget 32)
    assert "dflash, batch 2, tree budget 32" in labels


def test_each_drafting_method_gets_its_own_lines(report):
    mixed = copy.deepcopy(report)
    for r in report["results"]:
        if r["method"] != "ar":
            mixed["results"].append({**copy.deepcopy(r), "method": r["method"].replace("dflash", "lookup")})
    tau_ax, _ = plots.plot_tau_and_speedup(mixed)
    assert sorted(line.get_label() for line in tau_ax.lines) == [
        f"{method}, batch {batch}, tree budget 0" for method in ("dflash", "lookup") for batch in (1, 2)
    ]
    for line in tau_ax.lines:
        assert list(line.get_xdata()) == [2, 4]  # one point per block size, never two methods on a line


def test_cost_curve_plots_the_measured_verify_times_against_the_roofline_floor(report):
    ax = plots.plot_cost_curve(report)
    verify, floor, draft = ax.lines
    curve, roofline = report["cost_curve"], report["roofline"]
    assert list(verify.get_xdata()) == list(COST_SIZES)
    np.testing.assert_allclose(verify.get_ydata(), [curve["verify_s"][str(n)] * 1e3 for n in COST_SIZES])
    per_row = roofline["matmul_s"] / roofline["matmul_rows"]
    expected_floor = [max(roofline["weight_pass_s"], n * per_row) * 1e3 for n in COST_SIZES]
    np.testing.assert_allclose(floor.get_ydata(), expected_floor)
    assert list(draft.get_xdata()) == [curve["draft_block_size"]] == [4]


def test_bench_figure_has_every_panel_and_refuses_an_empty_report(report):
    assert len(plots.bench_figure(report).axes) == 4  # histogram, tau, speedup, cost curve
    plain = {**report, "results": [r for r in report["results"] if r["method"] == "ar"]}
    assert len(plots.bench_figure(plain).axes) == 1  # the cost curve alone
    del plain["cost_curve"]
    with pytest.raises(ValueError, match="nothing to plot"):
        plots.bench_figure(plain)


def test_a_bench_report_names_the_machine_it_ran_on(report):
    """Speedups on a CPU depend on its matmul units: the report says which CPU and flags it measured."""
    machine = report["machine"]
    assert machine["backend"] == "cpu" and machine["cpu_count"] >= 1
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    assert machine["cpu_flags"] == [flag for flag in roofline.CPU_FLAGS if flag in flags]
