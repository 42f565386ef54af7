"""`dflax validate`: a trained DFlash drafter's held-out numbers on any data directories, without training.

Training validates on the main data directory's held-out answers only, at the recipe's feature precision
and with the recipe's seed choosing the anchors, so two stages' numbers are not measured alike and a new
data source (code answers, follow-up turns) has no held-out figure at all. This runs the same validation
pass (`trainer.validation_pass`: loss, accuracy and conditional acceptance per block position, estimated
tau at the trained block size, and the acceptance at temperature 1: each position's overlap sum min(p, q)
of the target's next-token distribution and the drafter's, both over the draft vocabulary, p renormalised
there, so a little above what decoding at T=1 keeps; and what best-first draft trees of 0-64 nodes
commit, simulated per block: `dflax.train.tree_acceptance`) for every (drafter, data directory) pair on the
first `limit` answers of each directory's validation split, with one seed for every drafter, so the
drafters see the same anchors.

The recipe (block size, gamma, anchors per sequence, chunks) is read from the drafter's TRAINING.json, or
given; target features are computed by the prefill path at `feature_dtype` into `cache_dir` (kept
between calls when given, a temporary directory otherwise) and shared by drafters that tap the same
layers.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dflax.drafters import SHIPPED
from dflax.drafters.dflash import DFlashDrafter, DFlashProposer, init_drafter_params
from dflax.drafters.training_record import TRAINING_RECORD, recorded_recipe
from dflax.target import Target, weights_fingerprint
from dflax.train.batches import pad_sequences
from dflax.train.config import FEATURE_DTYPES, TrainConfig
from dflax.train.dataset import load_sequences
from dflax.train.features import cache_features
from dflax.train.recipe import build_recipe
from dflax.train.steps import dflash_loss_fn, dflash_taps, feature_program
from dflax.train.trainer import validation_pass
from dflax.train.warm_start import resolve_drafter_dir, warm_start_params, warm_start_vocab

# The anchors' seed for every drafter (a recipe's own seed would give each stage other anchors).
VALIDATION_SEED = 0


@dataclasses.dataclass(frozen=True)
class ValidationRow:
    """One (drafter, data directory) validation.

    Attributes:
      drafter: the drafter as named ("shipped" or its directory).
      data: the data directory whose validation split was read.
      sequences: held-out answers validated (those with a response inside the recipe's max_seq_len).
      block_size: the trained block size the estimated tau is for.
      metrics: `trainer.validation_pass`'s entry (val_loss, val_acc, val_accept, val_rank_accept,
        val_tau).
    """

    drafter: str
    data: str
    sequences: int
    block_size: int
    metrics: dict

    def to_dict(self) -> dict:
        """The row as JSON-ready values."""
        return dataclasses.asdict(self)


def drafter_recipe(drafter_dir: Path, recipe: TrainConfig | None = None) -> TrainConfig:
    """The recipe a drafter was trained with (its TRAINING.json), or `recipe` when given.

    Raises:
      ValueError: when the drafter carries no recipe and none is given, or it is not a DFlash drafter.
    """
    if recipe is None:
        recorded = recorded_recipe(drafter_dir)
        if recorded is None:
            raise ValueError(
                f"{drafter_dir} has no {TRAINING_RECORD} to read its training recipe from; pass the recipe "
                "it was trained with (--recipe configs/train/...json)"
            )
        recipe = build_recipe(TrainConfig, recorded, str(drafter_dir / TRAINING_RECORD))
    if recipe.method != "dflash":
        raise ValueError(
            f"validate runs DFlash drafters; {drafter_dir} was trained by method {recipe.method!r}"
        )
    return recipe


def recorded_target(drafter: str) -> str | None:
    """The target a drafter directory's TRAINING.json says it was trained against (None: no record, or
    "shipped", whose target is the one it is asked for)."""
    recorded = None if drafter == SHIPPED else recorded_recipe(Path(drafter))
    return None if recorded is None else recorded["target"]


def validate_drafters(
    drafters: Sequence[str],
    data_dirs: Sequence[str | Path],
    target: Target,
    *,
    limit: int = 64,
    feature_dtype: str = "float32",
    recipe: TrainConfig | None = None,
    cache_dir: str | Path | None = None,
    console: Console | None = None,
) -> list[ValidationRow]:
    """Validates each drafter on the held-out answers of each data directory.

    Args:
      drafters: drafter names, "shipped" or directories made by `dflax train`.
      data_dirs: data directories made by `dflax make-data` (their validation split is read).
      target: the loaded target the drafters were trained for.
      limit: held-out answers per data directory (the first ones).
      feature_dtype: the precision of the target forward that computes the features (FEATURE_DTYPES);
        "float32" is how a float32 target decodes.
      recipe: the training recipe of every drafter (default: each drafter's TRAINING.json).
      cache_dir: where the target features are kept for the next call (default: a temporary directory).
      console: where progress goes (default stderr).

    Returns:
      One ValidationRow per (drafter, data directory), drafter-major.

    Raises:
      ValueError: for an unknown feature dtype, a drafter without a recipe, or a data directory without
        held-out answers.
      FileNotFoundError: for a drafter or data directory that does not exist.
    """
    if feature_dtype not in FEATURE_DTYPES:
        raise ValueError(
            f"feature dtype {feature_dtype!r} unknown; choose one of {', '.join(FEATURE_DTYPES)}"
        )
    console = console or Console(stderr=True)
    held_out = {}
    for data in data_dirs:
        sequences = load_sequences(data, "validation", limit)
        if not sequences:
            raise ValueError(
                f"{data} holds no validation answers; make them with `dflax make-data --split validation`"
            )
        held_out[str(data)] = sequences
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    weights = weights_fingerprint(target)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dflax-validate-") as scratch, progress:
        features_dir = Path(cache_dir) if cache_dir is not None else Path(scratch)
        for name in drafters:
            drafter_dir = resolve_drafter_dir(name, target.name)
            config = drafter_recipe(drafter_dir, recipe)
            # The loss is the cross-entropy alone (no KL); the target's distribution is read for the
            # acceptance at temperature 1.
            config = dataclasses.replace(
                config, feature_dtype=feature_dtype, seed=VALIDATION_SEED, distill_weight=0.0
            )
            eval_step, params, taps = _drafter_program(drafter_dir, config, target)
            compute = feature_program(target.module, taps, config.feature_tokens, feature_dtype)
            for index, (data, sequences) in enumerate(held_out.items()):
                padded = pad_sequences(sequences, config.max_seq_len)
                stem = f"{index}-{Path(data).name}-{config.max_seq_len}"
                features = cache_features(
                    features_dir / f"{stem}.npy",
                    padded.tokens,
                    padded.lengths,
                    target=target,
                    weights=weights,
                    dtype=feature_dtype,
                    taps=taps,
                    compute=compute,
                    rows=config.feature_rows,
                    pack_tokens=config.feature_tokens,
                    progress=progress,
                    should_stop=lambda: False,
                )
                metrics = validation_pass(
                    eval_step, params, target.params, padded, features, config.batch_size, config.seed
                )
                rows.append(ValidationRow(name, str(data), len(padded), config.block_size, metrics))
    return rows


def _drafter_program(drafter_dir: Path, config: TrainConfig, target: Target):
    """(eval step, float32 parameters, tapped target layers) of the drafter at `drafter_dir`."""
    drafter_config = config.drafter_config(target)
    drafter_config.check_target(target.config)
    vocab = warm_start_vocab(drafter_dir, config.draft_vocab_size) if config.draft_vocab_size else None
    module = DFlashDrafter(drafter_config, jnp.float32, attention_backend="reference")
    params = warm_start_params(drafter_dir, drafter_config, init_drafter_params(module))
    proposer = DFlashProposer(module, target.module, config.block_size, draft_vocab=vocab)
    taps = dflash_taps(drafter_config, target.config, reads_target=True)
    return jax.jit(dflash_loss_fn(proposer, config, reads_target=True, tree_stats=True)), params, taps


def rows_table(rows: Sequence[ValidationRow], tree_nodes: Sequence[int] = (8, 16)) -> str:
    """The rows as a Markdown table: loss, accuracy at positions 1-3, estimated tau at T=0 (the chain of the
    trained block, and best-first trees of `tree_nodes` nodes over it) and at T=1."""
    trees = " / ".join(str(n) for n in tree_nodes)
    lines = [
        "| drafter | held-out answers | n | loss | acc@1 / @2 / @3 | est. tau | "
        f"est. tau, trees of {trees} nodes | est. tau at T=1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row.metrics
        acc = " / ".join(f"{a:.3f}" for a in np.asarray(m["val_acc"])[:3])
        tree_tau = " / ".join(f"{m['val_tree_tau'][n]:.3f}" for n in tree_nodes)
        lines.append(
            f"| {row.drafter} | {row.data} | {row.sequences} | {m['val_loss']:.3f} | {acc} | "
            f"{m['val_tau']:.3f} (B={row.block_size}) | {tree_tau} | {m['val_tau_t1']:.3f} |"
        )
    return "\n".join(lines)
