"""A DiffuSpec drafter from a diffusion LM directory, for `--method diffuspec --drafter DIR`.

`LOADERS` holds (matches, load) pairs tried in order, `matches(path) -> bool` saying whether a directory
is one the loader reads, `load(path, target) -> (DiffusionLM, params)`: Dream and LLaDA checkpoints
(dflax.diffusion.loader) and the drafter adapted from a target (dflax.diffusion.adapted_checkpoint, which
shares the target's embedding and LM head). Without a directory, the diffusion drafter dflax ships for the
target is used (`shipped_diffusion_drafter_path`).
A directory may also hold corpus n-gram counts for CPS, `ngram-3.npz` / `ngram-2.npz`
(dflax.drafters.ngram, as a DART drafter directory does).

`--window` takes `auto` (ADL with the published bounds [20, 30], a static window of 30), `MIN:MAX` (ADL
with those bounds, a window of MAX) or `K` (ADL off: k = K every step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflax.diffusion import loader as checkpoints
from dflax.diffusion.adapted_checkpoint import is_adapted_drafter_dir, load_adapted_drafter
from dflax.diffusion.adl import ADL_MAX, ADL_MIN
from dflax.diffusion.protocol import DiffusionLM
from dflax.diffusion.vocabulary import check_vocabulary
from dflax.drafters.diffuspec_proposer import DiffuSpecDrafter, diffuspec
from dflax.drafters.ngram import load_ngram_table
from dflax.drafters.shipped import shipped_diffusion_drafter_path
from dflax.target import Target


def _load_checkpoint(path: Path, target: Target) -> tuple[DiffusionLM, Any]:
    """A Dream or LLaDA checkpoint, after checking that it reads every token the target emits."""
    model, params = checkpoints.load_diffusion_lm(
        path, target.dtype, attention_backend=target.module.attention_backend
    )
    check_vocabulary(model.vocab_size, target.config.vocab_size, target.tokenizer.vocab_size)
    return model, params


# (matches(path), load(path, target) -> (DiffusionLM, params)), tried in order.
LOADERS: list[tuple[Callable[[Path], bool], Callable[[Path, Target], tuple[DiffusionLM, Any]]]] = [
    (is_adapted_drafter_dir, load_adapted_drafter),
    (checkpoints.is_diffusion_lm_dir, _load_checkpoint),
]


@dataclasses.dataclass(frozen=True)
class WindowSetting:
    """A parsed --window: the static window verified per step and ADL's bounds (None: ADL off).

    Attributes:
      window: K, slots drafted and verified per step.
      adl_bounds: ADL's (k_min, k_max), or None for a fixed k = K.
      label: the setting as given (auto, MIN:MAX or K); bench names runs by it.
    """

    window: int
    adl_bounds: tuple[int, int] | None
    label: str

    @classmethod
    def parse(cls, text: str) -> WindowSetting:
        """`auto`, `MIN:MAX` or `K` (see the module docstring).

        Raises:
          ValueError: for anything else, naming the accepted forms.
        """
        text = str(text).strip()
        try:
            if text == "auto":
                return cls(ADL_MAX, (ADL_MIN, ADL_MAX), text)
            if ":" in text:
                low, high = (int(x) for x in text.split(":"))
                if 1 <= low <= high:
                    return cls(high, (low, high), text)
            elif int(text) >= 1:
                return cls(int(text), None, text)
        except ValueError:
            pass
        raise ValueError(
            f"--window {text!r}: give auto (adaptive k in [{ADL_MIN}, {ADL_MAX}]), MIN:MAX (adaptive k in "
            "those bounds, e.g. 8:16) or K (a fixed k, e.g. 16)"
        )


def is_diffuspec_drafter_dir(path: str | Path) -> bool:
    """Whether one of the registered loaders reads this directory."""
    path = Path(path).expanduser()
    return path.is_dir() and any(matches(path) for matches, _ in LOADERS)


def load_diffusion_lm_dir(path: str | Path, target: Target) -> tuple[DiffusionLM, Any]:
    """The diffusion LM and its parameters from the first registered loader that reads `path`.

    Raises:
      FileNotFoundError: for a missing directory.
      ValueError: when no loader reads it.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"diffusion LM directory {str(path)!r} not found: give --drafter DIR")
    for matches, load in LOADERS:
        if matches(path):
            return load(path, target)
    raise ValueError(
        f"no diffusion LM loader matched {path}: --method diffuspec needs a masked diffusion LM directory "
        "that shares the target's tokenizer (a Dream or LLaDA checkpoint, or a diffusion drafter dflax "
        "adapted from the target), and this dflax has no loader that reads this one"
    )


def load_diffuspec(
    path: str | Path | None,
    target: Target,
    window: WindowSetting = WindowSetting.parse("auto"),
    refine_steps: int = 1,
    cps: bool = True,
) -> DiffuSpecDrafter:
    """A DiffuSpec drafter for `target` from a diffusion LM directory (and its n-gram counts, if any), or
    with `path` None from the diffusion drafter dflax ships for the target.

    Raises:
      FileNotFoundError / ValueError: for a missing directory, no shipped drafter, one no loader reads, a
        target on a mesh, or bad settings.
    """
    if path is None:
        path = shipped_diffusion_drafter_path(target.name)
        if path is None:
            raise FileNotFoundError(
                f"dflax ships no diffusion drafter for target {target.name!r}: give --drafter DIR, a masked "
                "diffusion LM directory sharing the target's tokenizer (a Dream or LLaDA checkpoint, or a "
                "drafter made by `dflax train --config configs/train/diffusion-smollm2.json`)"
            )
    if target.mesh is not None:
        raise ValueError(
            "DiffuSpec does not run on a device mesh yet: load the target without --mesh (one device)"
        )
    model, params = load_diffusion_lm_dir(path, target)
    path = Path(path).expanduser()
    tables = sorted(path.glob("ngram-*.npz"), key=lambda p: -int(p.stem.split("-")[1]))
    low, high = window.adl_bounds or (window.window, window.window)
    return diffuspec(
        model,
        params,
        window=window.window,
        refine_steps=refine_steps,
        cps=cps,
        adl=window.adl_bounds is not None,
        adl_min=low,
        adl_max=high,
        ngram=tuple(load_ngram_table(t) for t in tables),
        vocab_size=target.config.vocab_size,
        name=str(path),
    )
