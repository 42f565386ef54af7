"""Pictures of bench reports and training runs (matplotlib, rendered by the Agg backend).

Each `plot_*` function draws one panel onto a given Axes (or a new figure) from the structures dflax
writes: a `dflax bench` report (`run_bench`'s dict, or its `--json` file read back) and a training run's
`metrics.jsonl` records. `bench_figure` puts every panel a report has data for into one figure, which
`dflax bench --plot FILE.png` saves. Figures are made without pyplot, so drawing never switches the
process's matplotlib backend or keeps figures alive; in a notebook a returned Figure shows inline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

Report = dict[str, Any]
_BLOCK_SUFFIX = re.compile(r"-b(\d+)$")


def read_report(path: str | Path) -> Report:
    """A bench report written by `dflax bench --json`."""
    return json.loads(Path(path).read_text())


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a training run's metrics.jsonl (progress and validation entries, in order)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def new_figure(width: float, height: float = 4.0) -> Figure:
    """A figure drawn by Agg (savefig writes PNG), independent of pyplot's current backend."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _axes(ax: Axes | None) -> Axes:
    return ax if ax is not None else new_figure(6).add_subplot()


def _label(result: dict[str, Any]) -> str:
    return f"{result['method']} (batch {result['batch_size']})"


def speculative_results(report: Report) -> list[dict[str, Any]]:
    """The results that drafted (their accept histogram has more than the one-token bin), in order."""
    return [r for r in report["results"] if r.get("accept_hist") and len(r["accept_hist"]) > 2]


def block_size_of(report: Report, result: dict[str, Any]) -> int | None:
    """A speculative result's block size: its `block_size` field, its `-bB` suffix, or the report's one B."""
    if result.get("block_size"):
        return int(result["block_size"])
    match = _BLOCK_SUFFIX.search(result["method"])
    if match:
        return int(match.group(1))
    sizes = report.get("block_sizes") or []
    return int(sizes[0]) if len(sizes) == 1 else None


def plot_accepted_lengths(report: Report, ax: Axes | None = None) -> Axes:
    """Histogram of tokens committed per verify step, one bar series per speculative result.

    Bars are fractions of each result's steps at 1, 2, ..., n + 1 committed tokens (bonus token included).

    Raises:
      ValueError: when no result of the report drafted.
    """
    results = speculative_results(report)
    if not results:
        raise ValueError("the report has no speculative result (run bench with --method dflash)")
    ax = _axes(ax)
    width = 0.8 / len(results)
    for i, result in enumerate(results):
        hist = result["accept_hist"][1:]  # index = tokens committed; a step commits at least one
        steps = max(sum(hist), 1)
        x = [k + 1 + (i - (len(results) - 1) / 2) * width for k in range(len(hist))]
        ax.bar(x, [h / steps for h in hist], width=width, label=f"{_label(result)}, tau {result['tau']:.2f}")
    ax.set_xticks(range(1, max(len(r["accept_hist"]) for r in results)))
    ax.set_xlabel("tokens committed per verify step")
    ax.set_ylabel("fraction of steps")
    ax.set_title("accepted length")
    ax.legend(fontsize="small")
    return ax


def _series(report: Report) -> dict[tuple[str, int, Any], list[tuple[int, dict[str, Any]]]]:
    """Speculative results grouped by (method, batch size, tree budget), each group sorted by block size.
    The method is the result's name without its -bB / -tN / -auto suffix (dflash, lookup)."""
    groups: dict[tuple[str, int, Any], list[tuple[int, dict[str, Any]]]] = {}
    for result in speculative_results(report):
        size = block_size_of(report, result)
        if size is not None:
            key = (result["method"].split("-")[0], result["batch_size"], result.get("tree_budget"))
            groups.setdefault(key, []).append((size, result))
    return {key: sorted(points, key=lambda p: p[0]) for key, points in groups.items()}


def plot_tau_and_speedup(report: Report, axes: Sequence[Axes] | None = None) -> tuple[Axes, Axes]:
    """tau (left) and speedup over plain decoding (right) against block size.

    One line per method and batch size, and per tree budget when results carry `tree_budget`. The speedup
    panel has a dashed line at 1x (plain decoding's speed) and needs `ar` in the same report.

    Raises:
      ValueError: when no speculative result has a known block size.
    """
    series = _series(report)
    if not series:
        raise ValueError("the report has no speculative result with a block size to plot")
    if axes is None:
        axes = new_figure(10).subplots(1, 2)
    tau_ax, speed_ax = axes
    for (method, batch, budget), points in series.items():
        label = f"{method}, batch {batch}" + (f", tree budget {budget}" if budget is not None else "")
        sizes = [size for size, _ in points]
        tau_ax.plot(sizes, [r["tau"] for _, r in points], marker="o", label=label)
        speedups = [(size, r["speedup"]) for size, r in points if r.get("speedup") is not None]
        if speedups:
            speed_ax.plot(*zip(*speedups), marker="o", label=label)
    speed_ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, gid="plain-decoding")
    all_sizes = sorted({size for points in series.values() for size, _ in points})
    for ax, name in ((tau_ax, "tau (tokens per verify step)"), (speed_ax, "speedup over plain decoding")):
        ax.set_xlabel("block size B")
        ax.set_ylabel(name)
        _log2_ticks(ax, all_sizes)
        ax.legend(fontsize="small")
    tau_ax.set_title("tau per block size")
    speed_ax.set_title("decode speedup per block size")
    return tau_ax, speed_ax


def _log2_ticks(ax: Axes, values: Sequence[int]) -> None:
    """A base-2 log x axis labelled with the plotted values as plain integers."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(values), [str(v) for v in values])
    ax.minorticks_off()


def _floor_s(roofline: dict[str, Any], rows: int) -> float:
    """One forward's floor for `rows` tokens (see dflax.planning.roofline.step_floor_s; kept here so plotting
    needs no JAX)."""
    return max(roofline["weight_pass_s"], rows * roofline["matmul_s"] / roofline["matmul_rows"])


def plot_cost_curve(report: Report, ax: Axes | None = None) -> Axes:
    """Verify-forward time against tokens verified (bench --cost-curve), with this machine's floor.

    The floor (the report's `roofline`) is one pass over the weights, or the matmul time of that many
    rows when that is longer. A draft forward, when measured, is one marker at its block size.

    Raises:
      ValueError: when the report has no cost curve.
    """
    curve = report.get("cost_curve")
    if not curve:
        raise ValueError("the report has no cost curve (run bench with --cost-curve)")
    ax = _axes(ax)
    points = sorted((int(n), t) for n, t in curve["verify_s"].items())
    sizes = [n for n, _ in points]
    ax.plot(
        sizes, [t * 1e3 for _, t in points], marker="o", label=f"verify forward ({curve['context']} cached)"
    )
    roofline = report.get("roofline")
    if roofline:
        ax.plot(
            sizes,
            [_floor_s(roofline, n) * 1e3 for n in sizes],
            linestyle="--",
            color="gray",
            label="this machine's floor (roofline)",
        )
    if "draft_s" in curve:
        ax.plot(
            [curve["draft_block_size"]],
            [curve["draft_s"] * 1e3],
            marker="s",
            linestyle="none",
            label=f"draft forward (B={curve['draft_block_size']})",
        )
    _log2_ticks(ax, sizes)
    ax.set_xlabel("tokens verified in one forward")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("verify cost")
    ax.legend(fontsize="small")
    return ax


def bench_figure(report: Report) -> Figure:
    """Every panel the report has data for: accepted lengths, tau and speedup, the verify cost curve.

    Raises:
      ValueError: when the report has nothing to plot (no speculative result and no cost curve).
    """
    panels = []
    if speculative_results(report):
        panels.append("hist")
        if _series(report):
            panels += ["tau", "speedup"]
    if report.get("cost_curve"):
        panels.append("cost")
    if not panels:
        raise ValueError(
            "nothing to plot: the report has no speculative result and no cost curve; run bench with "
            "--method ar,dflash and/or --cost-curve"
        )
    fig = new_figure(5 * len(panels))
    axes = dict(zip(panels, fig.subplots(1, len(panels), squeeze=False)[0]))
    if "hist" in axes:
        plot_accepted_lengths(report, axes["hist"])
    if "tau" in axes:
        plot_tau_and_speedup(report, (axes["tau"], axes["speedup"]))
    if "cost" in axes:
        plot_cost_curve(report, axes["cost"])
    n = report.get("n_prompts")
    fig.suptitle(
        f"{report.get('target')} on {report.get('prompts')} ({n} prompts, T={report.get('temperature')})"
    )
    return fig


def plot_training(metrics: Sequence[dict[str, Any]], positions: int = 4, axes: Sequence[Axes] | None = None):
    """Validation curves of a training run: per-position acceptance (left) and estimated tau (right).

    Args:
      metrics: metrics.jsonl records (see `read_metrics`); the validation ones carry `val_accept`
        (P(draft k right | drafts before it right)) and `val_tau`.
      positions: draft positions drawn on the left (the first ones, where acceptance matters most).
      axes: two Axes to draw on (default: a new figure).

    Returns:
      The two Axes.

    Raises:
      ValueError: when no record is a validation.
    """
    val = [m for m in metrics if "val_tau" in m]
    if not val:
        raise ValueError("no validation records in these metrics (train with validation sequences)")
    if axes is None:
        axes = new_figure(10).subplots(1, 2)
    acc_ax, tau_ax = axes
    steps = [m["step"] for m in val]
    for k in range(min(positions, len(val[0]["val_accept"]))):
        acc_ax.plot(steps, [m["val_accept"][k] for m in val], marker="o", label=f"draft position {k + 1}")
    tau_ax.plot(steps, [m["val_tau"] for m in val], marker="o", label="estimated tau")
    acc_ax.set_ylabel("acceptance (given the drafts before)")
    acc_ax.set_title("validation acceptance per position")
    tau_ax.set_ylabel("tau (tokens per verify step)")
    tau_ax.set_title("validation tau")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    return acc_ax, tau_ax
