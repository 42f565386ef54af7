"""Which target and drafter to compile, from configs alone: no weights are read.

A target is a built-in name (its GGUF's metadata gives the config), an HF checkpoint directory or a
config.json; a drafter is "shipped", "untrained" (the default DFlash shape for the target), "none" (plain
autoregressive decoding), or a drafter directory / config.json in the official DFlash layout.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dflax.checkpoints.registry import BUILTIN_TARGETS, resolve
from dflax.drafters.checkpoint import config_from_json
from dflax.drafters.dflash import DFlashConfig
from dflax.drafters.drafter_files import DRAFT_VOCAB
from dflax.drafters.shipped import shipped_drafter_path
from dflax.models.config import ModelConfig

_CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# name -> (target, drafter): the configurations the compiled-memory table of docs/tpu-gpu.md reports.
PRESETS = {
    "smollm2-135m": ("smollm2-135m", "shipped"),
    "gemma3-270m": ("gemma3-270m", "untrained"),
    "qwen3-8b": (str(_CONFIGS / "models" / "qwen3-8b"), str(_CONFIGS / "drafters" / "dflash-qwen3-8b")),
    # Llama-3.1-8B-Instruct's public config.json; no official DFlash config is kept here, so the drafter is
    # dflax's default DFlash shape for the target (DFlashConfig.for_target), not the published one.
    "llama-3.1-8b": (str(_CONFIGS / "models" / "llama-3.1-8b"), "untrained"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class ModelPlan:
    """A target and its drafter as configs.

    Attributes:
      name: what the user asked for.
      target: the target's architecture.
      drafter: the DFlash drafter's architecture (None = plain autoregressive decoding).
      draft_vocab: [V'] token ids of a drafter with a pruned vocabulary (None = the whole vocabulary).
    """

    name: str
    target: ModelConfig
    drafter: DFlashConfig | None
    draft_vocab: np.ndarray | None = None


def _config_file(path: Path) -> Path:
    return path / "config.json" if path.is_dir() else path


def target_config(name_or_path: str) -> ModelConfig:
    """A target's config from a built-in name, an HF checkpoint directory or a config.json file.

    Raises:
      UnknownModelError: for anything else.
    """
    path = _config_file(Path(name_or_path).expanduser())
    if name_or_path not in BUILTIN_TARGETS and path.name == "config.json" and path.is_file():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    kind, found = resolve(name_or_path)
    if kind == "hf_dir":
        return ModelConfig.from_hf(json.loads((found / "config.json").read_text()))
    from dflax.checkpoints.gguf_file import read_gguf_config

    return read_gguf_config(found)


def drafter_config(
    spec: str, target_name: str, target: ModelConfig
) -> tuple[DFlashConfig | None, np.ndarray | None]:
    """A drafter's config and draft vocabulary from "none", "untrained", "shipped" or a path.

    Raises:
      FileNotFoundError: for a missing drafter or a target without a shipped drafter.
      ValueError: when the drafter does not fit the target.
    """
    if spec == "none":
        return None, None
    if spec == "untrained":
        config = DFlashConfig.for_target(target)
        config.check_target(target)
        return config, None
    path = shipped_drafter_path(target_name) if spec == "shipped" else Path(spec).expanduser()
    if path is None:
        raise FileNotFoundError(f"dflax ships no drafter for {target_name!r}; give a drafter directory")
    file = _config_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"drafter {spec!r}: no config.json at {file}")
    config = config_from_json(json.loads(file.read_text()))
    config.check_target(target)
    draft_vocab = None
    weights = file.parent / "model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), framework="numpy") as f:
            if DRAFT_VOCAB in f.keys():
                draft_vocab = np.asarray(f.get_tensor(DRAFT_VOCAB))
    return config, draft_vocab


def model_plan(name: str, drafter: str | None = None) -> ModelPlan:
    """A preset (see PRESETS) or any target, with a drafter spec (default: the preset's, else "none")."""
    target_spec, preset_drafter = PRESETS.get(name, (name, "none"))
    target = target_config(target_spec)
    config, draft_vocab = drafter_config(drafter or preset_drafter, target_spec, target)
    return ModelPlan(name, target, config, draft_vocab)
