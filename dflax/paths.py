"""Where dflax keeps what it builds once per machine: its cache directory, XLA's compilation cache, and
cache keys tied to the source that produced an entry."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path


def cache_dir() -> Path:
    """dflax's cache directory: `$DFLAX_CACHE` if set, else `~/.cache/dflax`."""
    return Path(os.environ.get("DFLAX_CACHE") or Path.home() / ".cache" / "dflax")


def enable_compilation_cache() -> Path:
    """Keeps XLA's compiled programs under `cache_dir()/xla`, so a shape compiles once per machine.

    The CLI does this for every command; notebooks and scripts call it once before generating.

    Returns:
      The compilation cache directory.
    """
    import jax

    path = cache_dir() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path


def source_hash(*modules: str) -> str:
    """A short sha256 of the named modules' source files, for cache keys of what that code converts.

    A cached conversion keyed on it is rebuilt whenever the converting code changes, so a stale entry
    cannot stand in for what the current code would produce (no hand-bumped version to forget).

    Args:
      modules: dotted module names, e.g. "dflax.checkpoints.gguf_file".
    """
    digest = hashlib.sha256()
    for name in modules:
        digest.update(Path(importlib.util.find_spec(name).origin).read_bytes())
    return digest.hexdigest()[:16]
