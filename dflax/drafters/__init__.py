"""Drafters: DFlash (block diffusion with KV injection), DART (parallel logits + n-gram-pruned trees),
DiffuSpec (a masked diffusion LM, CPS and ADL) and prompt lookup. `load_drafter` returns a DFlash or DART
drafter ready for `generate` (by what its directory holds), `load_dart` a DART one ("untrained" included),
`diffuspec` a DiffuSpec one from a diffusion LM, `prompt_lookup` a prompt-lookup one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dflax.drafters.checkpoint import load_drafter_checkpoint, save_drafter
from dflax.drafters.dart_checkpoint import is_dart_dir
from dflax.drafters.dart_loader import DartDrafterBound, load_dart
from dflax.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DFlashProposer,
    DraftSampling,
    init_drafter_params,
)
from dflax.drafters.dflash2 import DFlash2Config
from dflax.drafters.dflash2_checkpoint import save_dflash2_drafter
from dflax.drafters.dflash2_proposer import DFlash2Proposer, is_dflash2_dir, load_dflash2
from dflax.drafters.diffuspec_proposer import DiffuSpecDrafter, diffuspec
from dflax.drafters.lookup import LookupDrafter, prompt_lookup
from dflax.drafters.shipped import SHIPPED_DRAFTERS, named_drafter_path, shipped_drafter_path
from dflax.drafters.training_record import (
    measured_acceptance,
    measured_rank_acceptance,
    measured_tree_commits,
)
from dflax.sharding import ShardingRules
from dflax.sharding.placement import shard_params
from dflax.target import Target

UNTRAINED = "untrained"
SHIPPED = "shipped"


@dataclasses.dataclass(frozen=True, eq=False)
class Drafter:
    """A drafter bound to its target: config, parameters and the proposer the decode loop runs.

    Attributes:
      name: where it came from.
      config: its architecture.
      params: {"params": ...}.
      proposer: the static proposer (block size and draft sampling included).
      accept: measured per-position conditional acceptance acc_1, acc_2, ... (validation at the end of
        its training, from TRAINING.json), or None when unknown; `--block-size auto` predicts from it.
      rank_accept: measured rank acceptance [n][K] (dflax.planning.tree_budget), or None when unknown;
        `--block-size auto` weighs draft trees with it when `tree_commits` is unknown.
      tree_commits: E[c] and E[c^2] of the tokens a best-first tree of N nodes over the trained block
        commits, N = 0, 1, ... (simulated on held-out blocks at its final validation), or None.
    """

    name: str
    config: DFlashConfig | DFlash2Config
    params: dict
    proposer: DFlashProposer | DFlash2Proposer
    accept: tuple[float, ...] | None = None
    rank_accept: tuple[tuple[float, ...], ...] | None = None
    tree_commits: tuple[tuple[float, float], ...] | None = None

    @property
    def trained_block_size(self) -> int:
        """The block size it was trained with (the largest `--block-size auto` weighs)."""
        return self.config.block_size

    @property
    def drafts_greedily(self) -> bool:
        """Whether its drafts are argmaxes (trees need them)."""
        return self.proposer.draft_sampling.mode == "greedy"

    def with_block_size(self, block_size: int) -> Drafter:
        """The same drafter drafting blocks of another size (B - 1 drafts per step)."""
        if block_size < 2:
            raise ValueError(
                f"block size must be >= 2 (the anchor plus at least one draft), got {block_size}"
            )
        return dataclasses.replace(self, proposer=dataclasses.replace(self.proposer, block_size=block_size))

    def with_draft_sampling(self, draft_sampling: DraftSampling) -> Drafter:
        """The same drafter choosing its drafts by `draft_sampling` (greedy for trees, sampled or greedy for
        chains)."""
        proposer = dataclasses.replace(self.proposer, draft_sampling=draft_sampling)
        return dataclasses.replace(self, proposer=proposer)

    def with_tree_budget(self, tree_budget: int) -> Drafter:
        """The same drafter proposing best-first trees of `tree_budget` nodes over its block (0 = a chain).

        Raises:
          ValueError: for a negative budget, or a budget with sampled drafts (trees need greedy drafts).
        """
        return dataclasses.replace(self, proposer=dataclasses.replace(self.proposer, tree_budget=tree_budget))

    def save(self, path: str | Path, dtype: str = "float32") -> None:
        """Writes the drafter in the official DFlash layout (see dflax.drafters.checkpoint)."""
        target_layers = self.proposer.target.config.num_layers
        if isinstance(self.config, DFlash2Config):
            save_dflash2_drafter(path, self.config, self.params, target_layers, dtype)
            return
        save_drafter(path, self.config, self.params, target_layers, dtype, self.proposer.draft_vocab)


def load_drafter(
    name_or_path: str | Path,
    target: Target,
    block_size: int | None = None,
    draft_sampling: DraftSampling = DraftSampling(),
    seed: int = 0,
) -> Drafter | DartDrafterBound:
    """Loads a DFlash drafter (DFlash 2 from a DFlash 2 directory), or a DART drafter from a DART directory,
    for a target.

    Args:
      name_or_path: a drafter directory (official z-lab/dflash layout or one dflax saved; a DART directory,
        see dflax.drafters.dart_checkpoint, loads with `load_dart`), "shipped" for
        the drafter dflax ships for the target, the name of a shipped drafter (e.g. "smollm2-135m-official";
        see dflax.drafters.shipped), or "untrained" for a randomly
        initialised drafter at the target's width (tau near 1; for tests).
      target: the loaded target; the drafter shares its embedding and LM head.
      block_size: B at decode time; default the block size the drafter was trained with.
      draft_sampling: greedy drafts (delta rule, default) or sampled drafts (block verification).
      seed: initialisation seed for "untrained".

    Raises:
      ValueError: when the drafter does not fit the target (hidden size, vocabulary, layer ids).
      FileNotFoundError / CheckpointError: for a missing or broken checkpoint.
    """
    dtype = target.dtype
    if str(name_or_path) == SHIPPED:
        shipped = shipped_drafter_path(target.name)
        if shipped is None:
            raise FileNotFoundError(
                f"dflax ships no drafter for target {target.name!r} (shipped: "
                f"{', '.join(SHIPPED_DRAFTERS)}); give a drafter directory, e.g. one made by `dflax train`"
            )
        name_or_path = shipped
    elif named_drafter_path(str(name_or_path)) is not None:
        name_or_path = named_drafter_path(str(name_or_path))
    accept = rank_accept = tree_commits = None
    if str(name_or_path) == UNTRAINED:
        config = DFlashConfig.for_target(target.config)
        params, draft_vocab = None, None
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"drafter {name_or_path!r} not found: give a drafter directory (config.json + "
                f"*.safetensors) or {UNTRAINED!r}"
            )
        if is_dart_dir(path):
            dart = load_dart(path, target, seed=seed)
            return dart if block_size is None else dart.with_block_size(block_size)
        if is_dflash2_dir(path):  # chains through the candidate selector (dflax.drafters.dflash2_proposer)
            config, params, proposer = load_dflash2(path, target, block_size, draft_sampling)
            return Drafter(str(name_or_path), config, params, proposer)
        config, params, draft_vocab = load_drafter_checkpoint(path, dtype)
        accept, rank_accept = measured_acceptance(path), measured_rank_acceptance(path)
        tree_commits = measured_tree_commits(path)
    config.check_target(target.config)
    module = DFlashDrafter(config, dtype, target.module.attention_backend)
    if params is None:
        params = init_drafter_params(module, seed)
    if target.mesh is not None:  # split like the target's layers (dflax.sharding.rules)
        params = shard_params(params, ShardingRules.for_model(config.layers, target.mesh))
    proposer = DFlashProposer(
        module, target.module, block_size or config.block_size, draft_sampling, draft_vocab
    )
    drafter = Drafter(str(name_or_path), config, params, proposer, accept, rank_accept, tree_commits)
    return drafter.with_block_size(proposer.block_size)


__all__ = [
    "SHIPPED",
    "DFlashConfig",
    "DartDrafterBound",
    "DiffuSpecDrafter",
    "DraftSampling",
    "Drafter",
    "LookupDrafter",
    "diffuspec",
    "init_drafter_params",
    "load_dart",
    "load_drafter",
    "measured_acceptance",
    "measured_rank_acceptance",
    "measured_tree_commits",
    "prompt_lookup",
    "shipped_drafter_path",
]
