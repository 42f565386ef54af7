"""Drafters trained by dflax and shipped inside the package, one directory per built-in target.

Each directory is a DFlash checkpoint in the official layout (config.json + model.safetensors, bf16) with
a TRAINING.json recording how it was made (data, recipe, steps, wall time). `dflax generate` and
`load_drafter(SHIPPED, target)` use the one of the target's name. Adapted diffusion drafters for DiffuSpec
(dflax.diffusion.adapted_checkpoint) live beside them, in `<target>-diffusion`.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent

# target name -> directory of its shipped drafter
SHIPPED_DRAFTERS = {"smollm2-135m": _HERE / "smollm2-135m"}

# name -> directory of every shipped DFlash drafter, loadable as `--drafter NAME`: the defaults above and
# those in the official format (Qwen3 layers, a mask token; what the reference `dflash` runs)
NAMED_DRAFTERS = {**SHIPPED_DRAFTERS, "smollm2-135m-official": _HERE / "smollm2-135m-official"}

# target name -> directory of its shipped adapted diffusion drafter (DiffuSpec)
SHIPPED_DIFFUSION_DRAFTERS = {"smollm2-135m": _HERE / "smollm2-135m-diffusion"}


def shipped_drafter_path(target_name: str) -> Path | None:
    """The directory of the drafter shipped for a built-in target, or None when there is none."""
    path = SHIPPED_DRAFTERS.get(target_name)
    return path if path is not None and (path / "config.json").is_file() else None


def named_drafter_path(name: str) -> Path | None:
    """The directory of the shipped drafter called `name` (see NAMED_DRAFTERS), or None."""
    path = NAMED_DRAFTERS.get(name)
    return path if path is not None and (path / "config.json").is_file() else None


def shipped_diffusion_drafter_path(target_name: str) -> Path | None:
    """The directory of the diffusion drafter shipped for a built-in target, or None when there is none."""
    path = SHIPPED_DIFFUSION_DRAFTERS.get(target_name)
    return path if path is not None and (path / "config.json").is_file() else None
