"""`dflax pipeline`: data, training and export of a drafter as one resumable command.

A pipeline recipe (configs/pipeline/*.json) names a data recipe, a training recipe, how many prompts of
each split to answer, and where the result goes; `extra_data` adds training answers made under other data
recipes (other prompt sets, each in its own directory). Every step resumes (make-data keeps finished shards,
train restores its latest checkpoint), so an interrupted pipeline is rerun with the same command. The
exported drafter is copied to `ship_to` with TRAINING.json: what data it saw, the recipe, the steps, the
training wall time, the final validation numbers and every validation (per-position acceptance and
estimated tau), plotted in validation.png beside it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
from rich.console import Console

from dflax.target import Target, load_target
from dflax.train.dataset import load_sequences, read_manifest
from dflax.train.make_data import DataConfig, make_data
from dflax.train.recipe import build_recipe, read_recipe
from dflax.train.report import METRICS, TRAINING_RECORD, read_metrics, validation_history
from dflax.train.trainer import TrainConfig, TrainResult, train


def check_train_skip(train_skip: int, train_limit: int | None):
    """Raises ValueError unless 0 <= train_skip < train_limit (any train_skip >= 0 without a limit)."""
    if train_skip < 0 or (train_limit is not None and train_skip >= train_limit):
        raise ValueError(f"train_skip must be >= 0 and below train_limit ({train_limit}), got {train_skip}")


@dataclasses.dataclass(frozen=True)
class ExtraData:
    """More training answers from another data recipe, appended after the main data's.

    Attributes:
      data_config: path of the data recipe (configs/data/*.json), for the pipeline's target.
      data_dir: where make-data writes its shards (a directory of its own: one recipe per directory).
      train_limit: its training prompts to answer and train on (None = the whole split).
      train_skip: how many of its first training answers to leave out (answers an earlier stage saw).
    """

    data_config: str
    data_dir: str
    train_limit: int | None = None
    train_skip: int = 0

    def __post_init__(self):
        check_train_skip(self.train_skip, self.train_limit)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """One drafter's pipeline (configs/pipeline/*.json).

    Attributes:
      data_config: path of the data recipe (configs/data/*.json).
      train_config: path of the training recipe (configs/train/*.json).
      data_dir: where make-data writes its shards.
      run_dir: where train writes features, checkpoints, metrics and the exported drafter.
      validation_limit: held-out prompts to answer and validate on.
      train_limit: training prompts to answer and train on (None = the whole split).
      train_skip: how many of the first training answers to leave out: a stage warm-started from a
        drafter that trained on them continues on the ones it has not seen (make-data still makes them).
      ship_to: directory the exported drafter is copied to (None = leave it in run_dir/drafter).
      extra_data: more training answers from other data recipes (`ExtraData`, or its JSON object), trained
        on after the main data's; validation stays the main data's held-out answers.
      make_data: answer the prompts first (make-data, which skips finished shards); False trains on the
        answers the data directories already hold, without reading the prompt sources (an accelerator
        host that has the committed answers but not the prompt packages).
    """

    data_config: str
    train_config: str
    data_dir: str
    run_dir: str
    validation_limit: int = 32
    train_limit: int | None = None
    train_skip: int = 0
    ship_to: str | None = None
    extra_data: tuple[ExtraData, ...] = ()
    make_data: bool = True

    def __post_init__(self):
        check_train_skip(self.train_skip, self.train_limit)
        extra = tuple(
            x if isinstance(x, ExtraData) else build_recipe(ExtraData, x, "extra_data")
            for x in self.extra_data
        )
        object.__setattr__(self, "extra_data", extra)

    @classmethod
    def from_json(cls, path: str | Path) -> PipelineConfig:
        """Reads a recipe file; unknown keys are an error naming the known ones."""
        return read_recipe(cls, path)


def split_counts(sequences: list[tuple[np.ndarray, int]]) -> dict[str, int]:
    """How many sequences and response tokens a list of (ids, prompt length) holds."""
    return {"sequences": len(sequences), "response_tokens": int(sum(len(ids) - p for ids, p in sequences))}


def training_record(
    run_dir: Path,
    data_dir: Path,
    config: TrainConfig,
    result: TrainResult,
    splits: dict[str, list],
    extra: list[tuple[Path, list, int]] | None = None,
    train_skip: int = 0,
) -> dict:
    """What the shipped drafter was trained on, how long it took, how validation went and where it started.

    The data: the generation recipe from the manifest and the counts of the sequences in `splits` that
    training saw (and `train_skip`, the main data's first answers left out); with `extra` ([(data
    directory, its training sequences, its train_skip)]), each extra directory's recipe and the counts
    of its share (and its train_skip, when it left answers out).
    Then the steps, wall time, validation history (metrics.jsonl) and, for a warm start, the record of
    the drafter it started from."""
    manifest = read_manifest(data_dir) or {}
    metrics = read_metrics(run_dir / METRICS)
    progress = [m for m in metrics if "loss" in m]
    data = {"generation": manifest.get("generation"), **{k: split_counts(v) for k, v in splits.items()}}
    if train_skip:
        data["train_skip"] = train_skip
    if extra:
        data["extra"] = [
            {
                "generation": (read_manifest(d) or {}).get("generation"),
                "train": split_counts(seqs),
                **({"train_skip": skip} if skip else {}),
            }
            for d, seqs, skip in extra
        ]
    return {
        "data": data,
        "train": config.to_dict(),
        "steps": result.step,
        "train_wall_s": round(sum(m.get("seconds", 0.0) for m in progress), 1),
        "final_loss": progress[-1]["loss"] if progress else None,
        **validation_history(run_dir, metrics),
    }


def run_pipeline(
    pipeline: PipelineConfig,
    *,
    target: Target | None = None,
    dtype: str | None = None,
    attention_backend: str = "auto",
    console: Console | None = None,
):
    """Runs make-data (validation, train), train and the export; each step resumes.

    The target is `target`, or the training recipe's loaded with `dtype` and `attention_backend` (see
    `load_target`) once the recipes agree.

    Returns:
      The TrainResult of the training step (`interrupted` set when a signal stopped it).
    """
    console = console or Console(stderr=True)
    data_config = DataConfig.from_json(pipeline.data_config)
    train_config = TrainConfig.from_json(pipeline.train_config)
    extra_configs = [DataConfig.from_json(extra.data_config) for extra in pipeline.extra_data]
    recipes = [pipeline.data_config, *(extra.data_config for extra in pipeline.extra_data)]
    for path, config in zip(recipes, [data_config, *extra_configs]):
        if config.target != train_config.target:
            raise ValueError(
                f"the data recipe {path} targets {config.target!r} but the training recipe "
                f"{train_config.target!r}"
            )
    target = target or load_target(train_config.target, dtype=dtype, attention_backend=attention_backend)
    data_dir, run_dir = Path(pipeline.data_dir), Path(pipeline.run_dir)
    if pipeline.make_data:
        for split, limit in (("validation", pipeline.validation_limit), ("train", pipeline.train_limit)):
            console.rule(f"make-data {split}")
            make_data(data_config, data_dir, split=split, limit=limit, target=target, console=console)
        for extra, config in zip(pipeline.extra_data, extra_configs):
            console.rule(f"make-data train ({extra.data_dir})")
            make_data(config, extra.data_dir, limit=extra.train_limit, target=target, console=console)
    console.rule("train")
    # The data directory may hold more than this pipeline asked for (a later session added to it): train
    # on the first `train_limit` answers (less the first `train_skip`), the ones its recipe names, and
    # validate on the first `max_val_sequences` of the held-out ones (what the trainer takes).
    held_out = load_sequences(data_dir, "validation", pipeline.validation_limit)
    extra_sequences = [
        (Path(e.data_dir), load_sequences(e.data_dir, "train", e.train_limit)[e.train_skip :], e.train_skip)
        for e in pipeline.extra_data
    ]
    main = load_sequences(data_dir, "train", pipeline.train_limit)[pipeline.train_skip :]
    splits = {
        "train": main + [sequence for _, sequences, _ in extra_sequences for sequence in sequences],
        "validation": held_out[: train_config.max_val_sequences],
    }
    result = train(train_config, target, splits["train"], splits["validation"], run_dir, console=console)
    if result.drafter_dir is not None and pipeline.ship_to:
        ship = Path(pipeline.ship_to)
        if ship.exists():
            shutil.rmtree(ship)
        shutil.copytree(result.drafter_dir, ship)  # weights, TRAINING.json and validation.png
        record = training_record(
            run_dir, data_dir, train_config, result, splits, extra_sequences, pipeline.train_skip
        )
        (ship / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        console.print(f"drafter shipped to {ship}")
    return result
