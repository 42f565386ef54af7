"""Starts a training run from an exported drafter (warm start): training continues on a fresh machine.

A drafter directory (the shipped one, or any `dflax train` export) holds the weights but no optimizer
state, so a warm-started run begins a new schedule (warmup included) from those weights. The drafter must
have the architecture the recipe trains (same layers, tapped target layers, mask and feature norm); the
block size may differ (the weights do not depend on it) and so may the draft vocabulary (the LM head is
the target's; the run picks its own from its data, or keeps the parent's: `warm_start_vocab`).

A run may also start a drafter of another architecture from one (`init_match` "shapes"): every parameter
whose name and shape agree is copied, the rest keep their fresh initialisation. That is how a drafter in
the official layout (Qwen3 layers, a mask token, no feature norm) starts from the shipped one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflax.drafters import SHIPPED, shipped_drafter_path
from dflax.drafters.checkpoint import load_drafter_checkpoint
from dflax.drafters.dflash import DFlashConfig


def resolve_drafter_dir(init_from: str, target_name: str) -> Path:
    """The directory `init_from` names: "shipped" (the drafter dflax ships for the target) or a path.

    Raises:
      FileNotFoundError: when there is no such drafter.
    """
    if init_from == SHIPPED:
        path = shipped_drafter_path(target_name)
        if path is None:
            raise FileNotFoundError(
                f"init_from 'shipped': dflax ships no drafter for target {target_name!r}; give a drafter "
                "directory made by `dflax train`, or use init 'target'"
            )
        return path
    path = Path(init_from).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"init_from {init_from!r} is not a drafter directory (no config.json)")
    return path


def warm_start_params(path: Path, config: DFlashConfig, params: dict) -> dict:
    """The drafter's parameters read from `path`, checked against the architecture being trained.

    Args:
      path: a drafter directory.
      config: the drafter architecture of the run.
      params: freshly initialised parameters of that architecture (their tree, shapes and dtypes are kept).

    Returns:
      {"params": ...} in `params`' dtypes, in buffers of their own (a training step donates them).

    Raises:
      ValueError: when the drafter at `path` has another architecture.
    """
    loaded_config, loaded, _ = load_drafter_checkpoint(path, jnp.float32)
    mine = dataclasses.replace(config, block_size=loaded_config.block_size)
    if loaded_config != mine:
        fields = ("layers", "target_layer_ids", "mask_token_id", "feature_norm")
        diff = [f for f in fields if getattr(loaded_config, f) != getattr(mine, f)]
        raise ValueError(
            f"init_from {str(path)!r}: that drafter's {', '.join(diff)} differ from the recipe's; warm start "
            "needs the same architecture (match num_layers, layer_kind, target_layer_ids, mask_token_id and "
            "feature_norm in the recipe) or init 'target'"
        )
    return jax.tree.map(lambda new, old: jnp.array(old, new.dtype, copy=True), params, loaded)


def warm_start_matching_params(path: Path, params: dict) -> tuple[dict, list[str], list[str]]:
    """The drafter's parameters where name and shape agree with `params`, the fresh ones elsewhere.

    Args:
      path: a drafter directory (of any DFlash architecture at the same width).
      params: freshly initialised parameters of the architecture being trained.

    Returns:
      (params, copied, kept): the parameters in `params`' dtypes, in buffers of their own, and the
      '/'-joined names copied from `path` and kept fresh.
    """
    _, loaded, _ = load_drafter_checkpoint(path, jnp.float32)
    found = {
        "/".join(str(k.key) for k in key_path): leaf
        for key_path, leaf in jax.tree_util.tree_leaves_with_path(loaded)
    }
    copied, kept = [], []

    def pick(key_path, new):
        name = "/".join(str(k.key) for k in key_path)
        old = found.get(name)
        if old is not None and old.shape == new.shape:
            copied.append(name)
            return jnp.array(old, new.dtype, copy=True)
        kept.append(name)
        return jnp.array(new, copy=True)

    return jax.tree_util.tree_map_with_path(pick, params), copied, kept


def warm_start_vocab(path: Path, size: int) -> np.ndarray:
    """The pruned draft vocabulary [size] int32 of the drafter at `path`.

    Raises:
      ValueError: when that drafter drafts the whole vocabulary or a pruned one of another size.
    """
    _, _, vocab = load_drafter_checkpoint(path, jnp.float32)
    if vocab is None or len(vocab) != size:
        have = "the whole vocabulary" if vocab is None else f"{len(vocab)} tokens"
        raise ValueError(
            f"draft_vocab_from 'warm_start': the drafter at {str(path)!r} drafts {have}, not "
            f"draft_vocab_size={size}; set draft_vocab_size to match or draft_vocab_from 'data'"
        )
    return np.asarray(vocab, np.int32)
