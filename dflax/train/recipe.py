"""Reading recipe files (configs/*/*.json) into their frozen dataclasses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TypeVar

RecipeT = TypeVar("RecipeT")


def read_recipe(cls: type[RecipeT], path: str | Path) -> RecipeT:
    """Builds `cls` from a JSON file; unknown keys are an error naming the known ones (a typo must not
    silently fall back to a default)."""
    values = json.loads(Path(path).read_text(encoding="utf-8"))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known keys: {sorted(known)}")
    return cls(**values)
