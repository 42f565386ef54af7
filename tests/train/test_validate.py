"""`dflax validate` on a tiny target: a drafter's held-out numbers without training, as its training measured
them."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from rich.console import Console
from tiny_training import TINY, greedy_sequences, random_prompts, write_data_dir
from typer.testing import CliRunner

import dflax
from dflax.cli import app
from dflax.train.report import TRAINING_RECORD
from dflax.train.trainer import train
from dflax.train.validate import VALIDATION_SEED, validate_drafters

QUIET = Console(quiet=True)
RECIPE = dataclasses.replace(
    TINY,
    steps=40,
    validate_every=40,
    log_every=20,
    seed=VALIDATION_SEED,
    export_dtype="float32",  # the export is the final validation's parameters exactly
)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


@pytest.fixture(scope="module")
def held_out(target):
    """12 training and 8 validation answers: the tiny target's greedy continuations."""
    seqs = greedy_sequences(target, random_prompts(20, seed=1))
    return {"train": seqs[:12], "validation": seqs[12:]}


@pytest.fixture(scope="module")
def trained(target, held_out, tmp_path_factory):
    out = tmp_path_factory.mktemp("validate-run")
    return train(RECIPE, target, held_out["train"], held_out["validation"], out, console=QUIET)


def test_validate_gives_the_training_runs_own_final_validation(target, held_out, trained, tmp_path):
    data = write_data_dir(tmp_path / "data", held_out)
    (row,) = validate_drafters([str(trained.drafter_dir)], [data], target, console=QUIET)
    final = json.loads((trained.drafter_dir / TRAINING_RECORD).read_text())["final_validation"]
    assert row.sequences == 8 and row.block_size == 8
    np.testing.assert_allclose(row.metrics["val_loss"], final["val_loss"], rtol=1e-5)
    np.testing.assert_allclose(row.metrics["val_acc"], final["val_acc"], atol=1e-4)
    np.testing.assert_allclose(row.metrics["val_tau"], final["val_tau"], rtol=1e-5)
    assert row.metrics["val_tau"] > 1.0


def test_validate_gives_a_distilling_runs_acceptance_at_temperature_1(target, held_out, tmp_path):
    """The acceptance at T=1 (overlap with the target's distribution) that validate reports for any drafter
    is the one a training run that reads the target's distribution (distill_weight) measured."""
    recipe = dataclasses.replace(RECIPE, steps=20, validate_every=20, distill_weight=0.5)
    run = train(recipe, target, held_out["train"], held_out["validation"], tmp_path / "run", console=QUIET)
    data = write_data_dir(tmp_path / "data", held_out)
    (row,) = validate_drafters([str(run.drafter_dir)], [data], target, console=QUIET)
    final = json.loads((run.drafter_dir / TRAINING_RECORD).read_text())["final_validation"]
    np.testing.assert_allclose(row.metrics["val_accept_t1"], final["val_accept_t1"], atol=1e-4)
    np.testing.assert_allclose(row.metrics["val_tau_t1"], final["val_tau_t1"], rtol=1e-5)
    assert 1.0 < row.metrics["val_tau_t1"] <= 8.0
    np.testing.assert_allclose(row.metrics["val_acc"], final["val_acc"], atol=1e-4)  # greedy: unchanged


def test_drafters_share_anchors_and_features_and_a_recipe_can_be_given(target, held_out, trained, tmp_path):
    """Every drafter sees the same held-out anchors (one drafter under two names, on two copies of one
    data directory, gives one number four times); a drafter without TRAINING.json needs its recipe."""
    data = write_data_dir(tmp_path / "data", held_out)
    copy = shutil.copytree(data, tmp_path / "copy")
    bare = tmp_path / "bare"
    shutil.copytree(trained.drafter_dir, bare)
    (bare / TRAINING_RECORD).unlink()
    with pytest.raises(ValueError, match="--recipe"):
        validate_drafters([str(bare)], [data], target, console=QUIET)
    rows = validate_drafters(
        [str(trained.drafter_dir), str(bare)], [data, copy], target, recipe=RECIPE, limit=4,
        cache_dir=tmp_path / "cache", console=QUIET,
    )  # fmt: skip
    assert [(r.drafter, r.sequences) for r in rows] == [(str(trained.drafter_dir), 4)] * 2 + [
        (str(bare), 4)
    ] * 2
    assert rows[0].metrics == rows[1].metrics == rows[2].metrics == rows[3].metrics
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".json", ".json", ".npy", ".npy"]
    other = dataclasses.replace(RECIPE, seed=7)  # another seed: other anchors, another number
    (moved,) = validate_drafters([str(bare)], [data], target, recipe=other, limit=4, console=QUIET)
    assert moved.metrics == rows[2].metrics  # validate fixes the anchors' seed whatever the recipe's


def test_cli_validate_prints_a_table_and_writes_json(target, held_out, trained, tmp_path, tiny_checkpoint):
    data = write_data_dir(tmp_path / "data", held_out)
    no_split = write_data_dir(tmp_path / "no-validation", {"train": held_out["train"]})
    out = tmp_path / "rows.json"
    args = ["validate", "--drafter", str(trained.drafter_dir), "--data", str(data), "--limit", "4"]
    result = CliRunner().invoke(
        app, [*args, "--target", str(tiny_checkpoint("qwen3")[0]), "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "| drafter | held-out answers |" in result.output and "(B=8)" in result.output
    assert "est. tau at T=1" in result.output and "est. tau, trees of 8 / 16 nodes" in result.output
    (row,) = json.loads(out.read_text())
    assert row["sequences"] == 4 and len(row["metrics"]["val_accept"]) == 7
    missing = CliRunner().invoke(
        app, [*args[:3], "--data", str(no_split), "--target", str(tiny_checkpoint("qwen3")[0])]
    )
    assert missing.exit_code == 2 and "no 'validation' data" in " ".join(missing.output.split())
