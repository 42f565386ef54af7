"""What a drafter directory's TRAINING.json says: its measured acceptance (read by the cost model) and
the recipe it was trained with (read by `dflax validate`).

`dflax train` and `dflax pipeline` write TRAINING.json beside the exported weights; its
`final_validation` holds the per-position acceptance (`val_accept`) that `--block-size auto` predicts
chains from, and the simulated best-first trees' commits (`val_tree_tau`, `val_tree_square`) or, in older
records, the rank acceptance (`val_rank_accept`) that it predicts trees from.
"""

from __future__ import annotations

import json
from pathlib import Path

TRAINING_RECORD = "TRAINING.json"


def _record(path: Path) -> dict:
    record = Path(path) / TRAINING_RECORD
    if not record.is_file():
        return {}
    return json.loads(record.read_text(encoding="utf-8"))


def _final_validation(path: Path) -> dict:
    return _record(path).get("final_validation") or {}


def recorded_recipe(path: Path) -> dict | None:
    """The training recipe (TrainConfig fields) that a drafter directory's TRAINING.json recorded, or None
    when it records none."""
    return _record(path).get("train")


def measured_acceptance(path: Path) -> tuple[float, ...] | None:
    """The per-position acceptance that a drafter directory's TRAINING.json recorded at its final
    validation, or None when it records none."""
    accept = _final_validation(path).get("val_accept")
    return tuple(float(a) for a in accept) if accept else None


def measured_rank_acceptance(path: Path) -> tuple[tuple[float, ...], ...] | None:
    """The rank acceptance [n][K] that a drafter directory's TRAINING.json recorded at its final
    validation, or None when it records none."""
    ranks = _final_validation(path).get("val_rank_accept")
    return tuple(tuple(float(a) for a in row) for row in ranks) if ranks else None


def measured_tree_commits(path: Path) -> tuple[tuple[float, float], ...] | None:
    """E[c] and E[c^2] of the tokens a best-first tree of N nodes commits per step, N = 0, 1, ..., as a
    drafter directory's TRAINING.json recorded them at its final validation (held-out blocks' simulated
    trees, `dflax.train.tree_acceptance`), or None when it records none."""
    final = _final_validation(path)
    tau, square = final.get("val_tree_tau"), final.get("val_tree_square")
    return tuple((float(t), float(s)) for t, s in zip(tau, square)) if tau and square else None
