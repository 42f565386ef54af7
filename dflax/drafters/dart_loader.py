"""A DART drafter bound to its target, ready for `dflax.generate`: `load_dart`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dflax.drafters.dart import DartConfig, DartDrafter, DartParams, DartProposer, init_dart_params
from dflax.drafters.dart_checkpoint import ARCHITECTURE, is_dart_dir, load_dart_checkpoint, save_dart
from dflax.drafters.dart_tree import NgramPrior
from dflax.drafters.ngram import NgramTable
from dflax.drafters.training_record import measured_acceptance, measured_rank_acceptance
from dflax.target import Target

UNTRAINED = "untrained"
DART_TREE_BUDGET = 60  # the paper keeps the best ~60 nodes


@dataclasses.dataclass(frozen=True, eq=False)
class DartDrafterBound:
    """A DART drafter bound to its target.

    Attributes:
      name: where it came from.
      config: its architecture.
      params: the proposer's parameters (drafter weights, the target's embedding, n-gram priors).
      proposer: the static proposer (depth and tree budget included).
      ngram: the n-gram tables behind the priors (saved with the drafter).
      accept: measured per-depth acceptance (from TRAINING.json), or None.
      rank_accept: measured rank acceptance [d][K] (from TRAINING.json), or None; the cost model reads a
        best-first tree over it as the estimate of DART's beam tree of the same budget.
      tree_commits: None (DART's validation simulates no trees; the cost model reads `rank_accept`).
    """

    name: str
    config: DartConfig
    params: DartParams
    proposer: DartProposer
    ngram: tuple[NgramTable, ...] = ()
    accept: tuple[float, ...] | None = None
    rank_accept: tuple[tuple[float, ...], ...] | None = None
    tree_commits: tuple[tuple[float, float], ...] | None = None

    @property
    def trained_block_size(self) -> int:
        """The last token plus the d depths it was trained to draft."""
        return self.config.num_draft + 1

    @property
    def drafts_greedily(self) -> bool:
        """Always: DART drafts argmaxes and beam trees, verified by the delta rule."""
        return True

    def with_block_size(self, block_size: int) -> DartDrafterBound:
        """Chains of block_size - 1 drafts: the first block_size - 1 of the trained d positions (drafting is
        causal, so fewer positions are exactly a prefix of the forward)."""
        depth = block_size - 1
        if not 1 <= depth <= self.config.num_draft:
            raise ValueError(
                f"a DART drafter trained for {self.config.num_draft} positions drafts blocks of 2 to "
                f"{self.config.num_draft + 1} (the last token + drafts); got block size {block_size}"
            )
        return dataclasses.replace(self, proposer=dataclasses.replace(self.proposer, depth=depth))

    def with_tree_budget(self, tree_budget: int) -> DartDrafterBound:
        """The same drafter proposing DART beam trees of `tree_budget` nodes (0 = the argmax chain)."""
        return dataclasses.replace(self, proposer=dataclasses.replace(self.proposer, tree_budget=tree_budget))

    def with_ngram(self, tables: Sequence[NgramTable]) -> DartDrafterBound:
        """The same drafter whose beam uses these n-gram tables (orders 3 and/or 2; none = no n-gram term)."""
        tables = tuple(sorted(tables, key=lambda t: -t.order))
        bad = [t.order for t in tables if t.order not in (2, 3)]
        if bad:
            raise ValueError(f"DART's beam reads trigram and bigram counts; got n-gram orders {bad}")
        priors = tuple(NgramPrior.from_table(t) for t in tables)
        return dataclasses.replace(self, params=self.params.replace(ngram=priors), ngram=tables)

    def save(self, path: str | Path, dtype: str = "float32") -> None:
        """Writes the drafter directory (see dflax.drafters.dart_checkpoint)."""
        target_layers = self.proposer.target.config.num_layers
        save_dart(
            path,
            self.config,
            self.params.drafter,
            target_layers,
            dtype,
            self.proposer.draft_vocab,
            self.ngram,
        )


def load_dart(
    name_or_path: str | Path,
    target: Target,
    tree_budget: int = 0,
    seed: int = 0,
) -> DartDrafterBound:
    """Loads a DART drafter directory (or "untrained": random weights, no n-gram counts) for a target, with
    the acceptance its TRAINING.json measured (none for "untrained").

    Raises:
      ValueError: when the drafter does not fit the target, or the target is sharded over a mesh.
      FileNotFoundError / CheckpointError: for a missing or broken checkpoint.
    """
    if target.mesh is not None:
        raise ValueError(
            "DART does not run on a device mesh yet: load the target without mesh= (one device), or use "
            "--method dflash on the mesh"
        )
    draft_vocab, tables, accept, rank_accept = None, (), None, None
    if str(name_or_path) == UNTRAINED:
        config = DartConfig.for_target(target.config)
        params = None
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"DART drafter {name_or_path!r} not found: give a DART drafter directory or {UNTRAINED!r}"
            )
        if not is_dart_dir(path):
            raise ValueError(
                f"{path} is not a DART drafter directory (its config.json names no {ARCHITECTURE}); "
                "give one that `dflax train` exported from a DART recipe (configs/train/dart-smollm2.json)"
            )
        config, params, draft_vocab, tables = load_dart_checkpoint(path, target.dtype)
        accept, rank_accept = measured_acceptance(path), measured_rank_acceptance(path)
    config.check_target(target.config)
    module = DartDrafter(config, target.dtype)
    if params is None:
        params = init_dart_params(module, seed)
    embed = target.params["params"]["embed_tokens"]["weight"]
    vocab = None if draft_vocab is None else np.asarray(draft_vocab, np.int32)
    proposer = DartProposer(module, target.module, vocab, depth=config.num_draft)
    bound = DartDrafterBound(
        str(name_or_path), config, DartParams(params, embed), proposer, accept=accept, rank_accept=rank_accept
    )
    return bound.with_ngram(tables).with_tree_budget(tree_budget)
