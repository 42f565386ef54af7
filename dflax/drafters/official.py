"""Writing a dflax DFlash drafter in the official format, which the reference (`dflash`) loads unchanged.

The official format is the z-lab/dflash layout with nothing of dflax's own: Qwen3 decoder layers (q/k
norms), a mask token id from the target's vocabulary, no feature norm, the whole vocabulary read out.
`DFlashDraftModel.from_pretrained(DIR)` loads what `export_official` writes, and drafts what dflax drafts
(tests/drafters/test_reference_parity.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
from safetensors import safe_open

from dflax.drafters.checkpoint import load_drafter_checkpoint, save_drafter
from dflax.drafters.dflash import DFlashConfig
from dflax.drafters.training_record import TRAINING_RECORD

FORMATS = ("official",)


class NotOfficialFormatError(ValueError):
    """A drafter uses an option the official format (and so the reference) does not have."""


def official_format_problems(config: DFlashConfig, has_draft_vocab: bool) -> list[str]:
    """What keeps a drafter out of the official format, one line per option with the recipe key to change.

    Returns:
      [] when the drafter fits.
    """
    problems = []
    if config.layers.arch != "qwen3":
        problems.append(
            f"its layers are {config.layers.arch!r} (no q/k norms); the format has Qwen3 layers: "
            "train with layer_kind 'qwen3'"
        )
    if config.mask_token_id is None:
        problems.append("it has a learned mask embedding; the format masks with a token: set mask_token_id")
    if config.feature_norm:
        problems.append(
            "it normalizes each tapped feature (feature_norm); the format does not: feature_norm false"
        )
    if has_draft_vocab:
        problems.append(
            "it reads out a pruned draft vocabulary; the format reads out the whole one: draft_vocab_size 0"
        )
    return problems


def export_official(source: str | Path, out: str | Path) -> Path:
    """Writes the drafter at `source` to `out` in the official format (config.json + model.safetensors).

    The weights keep their stored precision (bfloat16 stays bfloat16); TRAINING.json, when present, is
    copied beside them.

    Args:
      source: a dflax DFlash drafter directory.
      out: the directory to write (created; files of the same names are replaced).

    Returns:
      `out` as a Path.

    Raises:
      NotOfficialFormatError: naming every option of the drafter that the format lacks.
      FileNotFoundError: when `source` is no drafter directory.
    """
    source, out = Path(source), Path(out)
    config, params, draft_vocab = load_drafter_checkpoint(source, jnp.float32)
    problems = official_format_problems(config, draft_vocab is not None)
    if problems:
        raise NotOfficialFormatError(
            f"the drafter at {source} does not fit the official DFlash format: "
            + "; ".join(problems)
            + ". Train a drafter with those options (e.g. configs/train/dflash-smollm2-official.json)."
        )
    num_target_layers = _num_target_layers(source)
    save_drafter(out, config, params, num_target_layers, _stored_dtype(source))
    if (source / TRAINING_RECORD).is_file() and source.resolve() != out.resolve():
        shutil.copyfile(source / TRAINING_RECORD, out / TRAINING_RECORD)
    return out


def _num_target_layers(source: Path) -> int:
    data = json.loads((source / "config.json").read_text())
    return int(data["num_target_layers"])


def _stored_dtype(source: Path) -> str:
    """"bfloat16" when any of the drafter's weights are stored in bfloat16, else "float32"."""
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                if f.get_slice(name).get_dtype() == "BF16":
                    return "bfloat16"
    return "float32"
