"""The recipe of an adapted diffusion drafter (`method: "diffusion"` in configs/train/*.json)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dflax.train.recipe import read_recipe


@dataclasses.dataclass(frozen=True)
class DiffusionTrainConfig:
    """How `dflax train` makes an adapted diffusion drafter (dflax.diffusion.adapted_drafter).

    Attributes:
      method: "diffusion" (what sends a recipe here instead of the DFlash/DART trainer).
      target: the target it is adapted from (built-in name, .gguf or HF directory).
      source_layers: target layers copied into the drafter, in order.
      mask_token_id: a target id its data never uses, marking slots to fill.
      window: K, slots per training window.
      windows_per_seq: M windows per sequence per step, all in one forward.
      all_masked_frac: fraction of windows masked entirely (DiffuSpec's one-step drafts); the rest mask
        each slot with a probability drawn uniformly per window.
      gamma: slot k's loss weight exp(-(k - 1) / gamma).
      attention_chunk: blocks whose attention scores are held at once (memory only).
      logits_chunk: window rows per LM-head chunk (memory only).
      max_seq_len: S, sequences truncated / padded to it.
      batch_size: sequences per step.
      lr, warmup_frac, weight_decay, clip_norm: AdamW on linear warmup + cosine decay to 0, clipped.
      epochs: passes over the training sequences (when `steps` is None); steps: total optimizer steps.
      checkpoint_every, validate_every, log_every: steps between checkpoints, validations, progress lines.
      max_val_sequences: held-out sequences validated on.
      seed: data order, windows and the mask embedding's initialisation.
      export_dtype: "bfloat16" or "float32".
    """

    method: str = "diffusion"
    target: str = "smollm2-135m"
    source_layers: tuple[int, ...] = (0, 1, 28, 29)
    mask_token_id: int = 16
    window: int = 16
    windows_per_seq: int = 32
    all_masked_frac: float = 0.5
    gamma: float = 7.0
    attention_chunk: int = 64
    logits_chunk: int = 32
    max_seq_len: int = 384
    batch_size: int = 4
    lr: float = 3e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    epochs: int = 1
    steps: int | None = None
    checkpoint_every: int = 25
    validate_every: int = 100
    log_every: int = 5
    max_val_sequences: int = 32
    seed: int = 0
    export_dtype: str = "bfloat16"

    def __post_init__(self):
        object.__setattr__(self, "source_layers", tuple(self.source_layers))
        if self.method != "diffusion":
            raise ValueError(f"a diffusion recipe has method 'diffusion', got {self.method!r}")
        positive = ("window", "windows_per_seq", "attention_chunk", "logits_chunk", "batch_size", "epochs")
        for name in positive + ("checkpoint_every", "validate_every", "log_every", "max_val_sequences"):
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
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"training config: steps must be >= 1 or null, got {self.steps}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"training config: warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if self.export_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"training config: export_dtype {self.export_dtype!r}; use bfloat16 or float32")

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
