"""Shared fixtures: tiny checkpoints are built once per session and reused by every test."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Tests run on the CPU in float32; keep XLA from grabbing every core for one op.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every run gets its own empty dflax cache (GGUF conversions, tokenizers, joined model files, XLA cache), so
# nothing a previous run or another checkout converted can stand in for what this code converts. Set before
# dflax is imported and inherited by the subprocesses tests start.
os.environ["DFLAX_CACHE"] = tempfile.mkdtemp(prefix="dflax-test-cache-")
atexit.register(shutil.rmtree, os.environ["DFLAX_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(name) -> (path of a saved tiny HF checkpoint, the torch model)."""
    from tiny_checkpoints import save_tiny_checkpoint

    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (path, save_tiny_checkpoint(name, path))
        return built[name]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (float32), loaded once per session."""
    import dflax

    return dflax.load_target("smollm2-135m")
