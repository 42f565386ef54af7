"""The recipe of an adapted diffusion drafter (`method: "diffusion"` in configs/train/*.json)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dflax.train.recipe import RunSettings, read_recipe


@dataclasses.dataclass(frozen=True)
class DiffusionTrainConfig(RunSettings):
    """How `dflax train` makes an adapted diffusion drafter (dflax.diffusion.adapted_drafter); the fields of
    RunSettings as well (`attention_chunk` counts windows, `logits_chunk` window rows).

    Attributes:
      method: "diffusion" (what sends a recipe here instead of the DFlash/DART trainer).
      source_layers: target layers copied into the drafter, in order.
      mask_token_id: a target id its data never uses, marking slots to fill.
      window: K, slots per training window.
      windows_per_seq: M windows per sequence per step, all in one forward.
      all_masked_frac: fraction of windows masked entirely (DiffuSpec's one-step drafts); the rest mask
        each slot with a probability drawn uniformly per window.
      gamma: slot k's loss weight exp(-(k - 1) / gamma).
    """

    method: str = "diffusion"
    source_layers: tuple[int, ...] = (0, 1, 28, 29)
    mask_token_id: int = 16
    window: int = 16
    windows_per_seq: int = 32
    all_masked_frac: float = 0.5
    gamma: float = 7.0

    def __post_init__(self):
        object.__setattr__(self, "source_layers", tuple(self.source_layers))
        if self.method != "diffusion":
            raise ValueError(f"a diffusion recipe has method 'diffusion', got {self.method!r}")
        self.check_run_settings()
        for name in ("window", "windows_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"training config: {name} must be >= 1, got {getattr(self, name)}")
        if not self.source_layers:
            raise ValueError("training config: source_layers must name at least one target layer")
        if not 0.0 <= self.all_masked_frac <= 1.0:
            raise ValueError(
                f"training config: all_masked_frac must be in [0, 1], got {self.all_masked_frac}"
            )
        if self.gamma <= 0:
            raise ValueError(f"training config: gamma must be > 0, got {self.gamma}")
        if self.max_seq_len < self.window + 2:
            raise ValueError(f"training config: max_seq_len {self.max_seq_len} < window + 2; raise it")

    @classmethod
    def from_json(cls, path: str | Path) -> DiffusionTrainConfig:
        """Reads a recipe file; unknown keys are an error naming the known ones."""
        return read_recipe(cls, path)

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return {**dataclasses.asdict(self), "source_layers": list(self.source_layers)}


def is_diffusion_recipe(path: str | Path) -> bool:
    """Whether a recipe file names method "diffusion" (False for other recipes and unreadable files, which
    the DFlash recipe reader then reports)."""
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(values, dict) and values.get("method") == "diffusion"
