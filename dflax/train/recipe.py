"""Reading recipe files (configs/*/*.json) into their frozen dataclasses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TypeVar

RecipeT = TypeVar("RecipeT")


def build_recipe(cls: type[RecipeT], values: dict, where: str) -> RecipeT:
    """Builds `cls` from a JSON object; unknown keys are an error that names `where` and the known keys (a
    typo must not silently fall back to a default)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known keys: {sorted(known)}")
    return cls(**values)


def read_recipe(cls: type[RecipeT], path: str | Path) -> RecipeT:
    """Builds `cls` from a JSON file (see `build_recipe`)."""
    return build_recipe(cls, json.loads(Path(path).read_text(encoding="utf-8")), str(path))


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What every training recipe (DFlash, DART, diffusion drafters) sets besides its model and objective.

    Attributes:
      target: the target to train against (built-in name, .gguf or HF directory).
      attention_chunk: blocks (anchors' blocks, or diffusion windows) whose attention scores are held at
        once (memory: batch_size * chunk * heads * B * (max_seq_len + B) floats); the work does not
        depend on it.
      logits_chunk: block rows per LM-head chunk (memory: chunk * (B - 1) * vocab floats).
      max_seq_len: S, sequences are truncated / padded to this length.
      batch_size: sequences per step.
      lr: peak learning rate.
      warmup_frac: fraction of the steps spent warming up linearly (then cosine decay to 0).
      weight_decay: AdamW decoupled weight decay.
      clip_norm: global gradient-norm clip.
      epochs: passes over the training sequences (when `steps` is None).
      steps: total optimizer steps (overrides `epochs`).
      checkpoint_every: steps between orbax checkpoints (and one at the end and on SIGTERM/SIGINT).
      validate_every: steps between validations on the held-out sequences (and one at the end).
      log_every: steps between progress updates (metrics are fetched from the device then).
      max_val_sequences: held-out sequences used for validation.
      seed: initialisation, data order and the objective's random choices.
      export_dtype: dtype of the exported drafter weights ("bfloat16" or "float32").
    """

    target: str = "smollm2-135m"
    attention_chunk: int = 64
    logits_chunk: int = 32
    max_seq_len: int = 384
    batch_size: int = 4
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    epochs: int = 6
    steps: int | None = None
    checkpoint_every: int = 500
    validate_every: int = 500
    log_every: int = 10
    max_val_sequences: int = 64
    seed: int = 0
    export_dtype: str = "bfloat16"

    def check_run_settings(self) -> None:
        """Raises ValueError naming the first run setting out of range."""
        positive = ("attention_chunk", "logits_chunk", "batch_size", "epochs", "checkpoint_every")
        for name in positive + ("validate_every", "log_every", "max_val_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"training config: {name} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"training config: steps must be >= 1 or null, got {self.steps}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"training config: warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if self.export_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"training config: export_dtype {self.export_dtype!r}; use bfloat16 or float32")
