"""The training report beside a run's checkpoints: TRAINING.json (validation history) and a plot of it.

Every validation appends a record to `metrics.jsonl`; from that file the trainer rewrites
`TRAINING.json` (the recipe, the steps and every validation: loss, per-position accuracy, per-position
greedy acceptance and the estimated tau) and `validation.png` (tau and acc@1 over the steps, and the
acceptance per block position at the first and latest validation). A run killed after its last checkpoint
repeats the steps since then, so records of a repeated step replace the earlier ones. A warm-started run
keeps the TRAINING.json of the drafter it started from (`warm_start.json`, written when the run begins,
before a pipeline ships over that drafter), so a drafter trained in stages records every stage.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflax.drafters.training_record import TRAINING_RECORD
from dflax.train.dataset import write_atomically

PLOT = "validation.png"
METRICS = "metrics.jsonl"
WARM_START = "warm_start.json"


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl in step order, the last record of each (step, kind) kept
    (kind: progress records carry "loss", validation records "val_tau")."""
    path = Path(path)
    if not path.exists():
        return []
    latest = {}
    for line in path.read_text().splitlines():
        if line:
            entry = json.loads(line)
            latest[(entry["step"], "val_tau" in entry)] = entry
    return [latest[k] for k in sorted(latest)]


def plot_validation(validation: list[dict], path: Path) -> None:
    """Writes the validation plot (PNG): tau and acc@1 over the steps, acceptance per block position."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [v["step"] for v in validation]
    fig, (over_steps, per_position) = plt.subplots(1, 2, figsize=(11, 4))
    over_steps.plot(steps, [v["val_tau"] for v in validation], "o-", label="estimated tau")
    over_steps.set_xlabel("step")
    over_steps.set_ylabel("tau (tokens per verify step)")
    accuracy = over_steps.twinx()
    accuracy.plot(steps, [v["val_acc"][0] for v in validation], "s--", color="tab:orange", label="acc@1")
    accuracy.set_ylabel("acc@1")
    accuracy.set_ylim(0, 1)
    over_steps.legend(loc="upper left")
    accuracy.legend(loc="lower right")
    over_steps.set_title("validation")
    for v in (validation[0], validation[-1]) if len(validation) > 1 else validation:
        positions = range(1, len(v["val_accept"]) + 1)
        label = f"step {v['step']} (tau {v['val_tau']:.2f})"
        per_position.plot(positions, v["val_accept"], "o-", label=label)
    per_position.set_xlabel("block position k")
    per_position.set_ylabel("P(draft k accepted | drafts < k accepted)")
    per_position.set_ylim(0, 1)
    per_position.legend()
    per_position.set_title("greedy acceptance per position")
    fig.tight_layout()
    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


def record_warm_start(out_dir: Path, init_from: str | None, parent: Path | None) -> None:
    """Keeps what a fresh run starts from: for a warm start, the recipe's `init_from` ("shipped" or a
    path) and the TRAINING.json of `parent`, the directory it names (None when it has none); for a run
    that starts from scratch (`parent` None), nothing: a stale record is removed."""
    path = out_dir / WARM_START
    if parent is None:
        path.unlink(missing_ok=True)
        return
    parent_record = parent / TRAINING_RECORD
    record = json.loads(parent_record.read_text()) if parent_record.is_file() else None
    data = {"from": init_from, "record": record}
    write_atomically(path, lambda f: f.write(json.dumps(data).encode()))


def read_warm_start(out_dir: Path) -> dict | None:
    """The record `record_warm_start` kept for a run ({"from", "record"}), or None."""
    path = out_dir / WARM_START
    return json.loads(path.read_text()) if path.is_file() else None


def validation_history(out_dir: Path, metrics: list[dict]) -> dict:
    """The tail every TRAINING.json ends with: "final_validation" (the latest validation record or None),
    "validation" (every one, from a run's `metrics`) and, for a warm-started run, "warm_start"."""
    validation = [m for m in metrics if "val_tau" in m]
    history = {"final_validation": validation[-1] if validation else None, "validation": validation}
    warm_start = read_warm_start(out_dir)
    if warm_start is not None:
        history["warm_start"] = warm_start
    return history


def write_report(out_dir: Path, train_config: dict, total_steps: int) -> dict:
    """Rewrites out_dir/TRAINING.json and out_dir/validation.png from out_dir/metrics.jsonl.

    Returns:
      The TRAINING.json dictionary: {"train", "total_steps", "steps", "final_validation": the latest
      record or None, "validation": [records], and "warm_start" (`read_warm_start`) for a warm-started
      run} (the exported drafter carries a copy: its final_validation is what `--block-size auto`
      predicts from).
    """
    metrics = read_metrics(out_dir / METRICS)
    history = validation_history(out_dir, metrics)
    record = {
        "train": train_config,
        "total_steps": total_steps,
        "steps": max((m["step"] for m in metrics), default=0),
        **history,
    }
    write_atomically(out_dir / TRAINING_RECORD, lambda f: f.write(json.dumps(record, indent=2).encode()))
    if history["validation"]:
        plot_validation(history["validation"], out_dir / PLOT)
    return record
